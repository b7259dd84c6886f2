"""--wandb-project: the scalars tensorboard gets, logged to Weights & Biases too (rank 0).

As in Megatron-LM: the run is named --wandb-exp-name, belongs to --wandb-entity (default:
the API key's default entity), written under --wandb-save-dir
(default <--save>/wandb), with the run's settings as its config. wandb is optional: the
package is imported only here, and a run that asks for it without it installed stops at
start-up (config/rules.py).

Offline unless told otherwise: a machine without network would otherwise wait on the
server at start-up. WANDB_MODE, when set, decides; else an API key (WANDB_API_KEY, or
`wandb login`'s entry in ~/.netrc) means online; else the run is offline and its files
stay in --wandb-save-dir for `wandb sync` to upload later. The start-up log says which,
and why.
"""

from __future__ import annotations

import dataclasses
import logging
import netrc
import os
from typing import Any, Literal, Optional
from urllib.parse import urlparse

from megaulysses.config import RunConfig
from megaulysses.config.fields import filled

log = logging.getLogger(__name__)


class WandbWriter:
    """A wandb run that takes {name: value} scalars at an iteration."""

    def __init__(self, run: Any):
        self.run = run

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_wandb(cfg: RunConfig) -> Optional[WandbWriter]:
    """The run --wandb-project asks for, or None without it."""
    lg = cfg.log
    if not lg.wandb_project:
        return None
    import wandb  # optional: imported only for a run that asks for it
    mode, why = wandb_mode()
    effective = mode or os.environ["WANDB_MODE"]
    save_dir = filled(lg.wandb_save_dir, "--wandb-save-dir")  # resolve(): <--save>/wandb
    os.makedirs(save_dir, exist_ok=True)
    # console="off": our log lines stay ours (wandb would wrap stdout to copy them);
    # silent: the line below says what wandb's own banner would
    # entity: --wandb-entity, or None ('' is Megatron-LM's default): the key's default one
    run = wandb.init(project=lg.wandb_project, entity=lg.wandb_entity or None,
                     name=lg.wandb_exp_name, dir=save_dir,
                     config=dataclasses.asdict(cfg), mode=mode,
                     settings=wandb.Settings(console="off", silent=True))
    log.info("wandb: run %r of project %r%s, %s (%s), files in %s%s", lg.wandb_exp_name,
             lg.wandb_project, f" (entity {lg.wandb_entity!r})" if lg.wandb_entity else "",
             effective, why, run.dir,
             "; `wandb sync` uploads them later" if effective == "offline" else "")
    return WandbWriter(run)


def wandb_mode() -> tuple[Optional[Literal["online", "offline"]], str]:
    """(the mode to ask wandb.init for, None to leave WANDB_MODE's; the reason)."""
    if os.environ.get("WANDB_MODE"):
        return None, "WANDB_MODE"
    if os.environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    if _netrc_has_key():
        return "online", "an API key in ~/.netrc"
    return "offline", "no WANDB_MODE and no API key"


def _netrc_has_key() -> bool:
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    if host is None:  # WANDB_BASE_URL without a scheme: no host to look up
        return False
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
