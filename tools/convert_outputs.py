"""Output directories of tools/convert_checkpoint.py: written aside, renamed into place,
so a failed conversion leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from hf_errors import ConvertError

def check_target(path: str, flag: str, force: bool):
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConvertError(flag, f"{path} exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path) and not force:
        raise ConvertError(flag, f"{path} exists and is not empty (pass --force to replace it)")


@contextlib.contextmanager
def staged(path: str):
    """Yield a temporary directory next to `path`; on success it replaces `path`."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.tmp-",
                           dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would stay on the output
        yield tmp
        old = None
        if os.path.exists(path):  # empty, or --force: keep it until the new one is in place
            old = tempfile.mkdtemp(prefix=".old-", dir=parent)
            os.replace(path, os.path.join(old, "x"))
        os.replace(tmp, path)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
