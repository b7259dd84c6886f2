"""Weights between our parameter names and a family's (hf_families.Link), and the files
that hold them on the Hugging Face side: model.safetensors, or shards
model-00001-of-0000N.safetensors with model.safetensors.index.json (the Hub's layout for
big models; pytorch_model.bin and its shards are read too).
"""

from __future__ import annotations

import json
import os
import re

from hf_errors import ConvertError
from hf_families import Link, base_prefix, links_for

DTYPES = ("float32", "bfloat16", "float16")
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"  # the Hub's usual shard (transformers 4's default)
_UNITS = {"": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def shard_size(text: str) -> int:
    """--max-shard-size: bytes, or a number with KB, MB, GB (powers of 10) or KiB, MiB, GiB
    (powers of 2), as transformers spells them."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]i?b)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) <= 0:
        raise ConvertError("--max-shard-size", f"{text!r} is not a positive size like 5GB, "
                                               "500MB, 2GiB or a number of bytes")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


# -- one tensor each way ------------------------------------------------------------------------

def to_hf_tensor(link: Link, state: dict):
    import torch
    parts = [state[name] for name in link.ours]
    if link.kind == "same":
        return parts[0]
    if link.kind == "1p":
        return parts[0] + 1.0
    if link.kind == "t":
        return parts[0].t()
    fused = torch.cat(parts, dim=0)
    return fused.t() if link.kind == "fused_t" else fused


def from_hf_tensor(link: Link, tensor, shapes: dict) -> dict:
    """{our name: tensor}; `shapes` (our parameter shapes) give the q/k/v split."""
    if link.kind == "1p":
        return {link.ours[0]: tensor - 1.0}
    if link.kind in ("same", "t"):
        return {link.ours[0]: tensor.t() if link.kind == "t" else tensor}
    rows = [shapes[name][0] for name in link.ours]
    fused = tensor.t() if link.kind == "fused_t" else tensor
    return dict(zip(link.ours, fused.split(rows, dim=0), strict=True))


def our_shapes(cfg) -> dict:
    """{parameter name: shape} of our GPT for cfg, built on the meta device (no memory)."""
    import torch
    from megaulysses.model.gpt import GPT
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in GPT(cfg).state_dict().items()}


# -- reading a Hugging Face directory ----------------------------------------------------------

def _weight_files(hf_dir: str) -> list:
    for index in (SAFE_INDEX, "pytorch_model.bin.index.json"):
        path = os.path.join(hf_dir, index)
        if os.path.exists(path):
            try:
                with open(path) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConvertError(path, f"unreadable ({e})") from None
            return [os.path.join(hf_dir, s) for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(hf_dir, name)):
            return [os.path.join(hf_dir, name)]
    raise ConvertError("--hf-dir", f"{hf_dir} has no model.safetensors or pytorch_model.bin")


def read_hf_weights(hf_dir: str) -> dict:
    import torch
    from safetensors.torch import load_file
    weights: dict[str, torch.Tensor] = {}
    for path in _weight_files(hf_dir):
        try:
            weights.update(load_file(path) if path.endswith(".safetensors") else
                           torch.load(path, map_location="cpu", weights_only=True))
        except Exception as e:  # SafetensorError, unpickling errors, missing shards
            raise ConvertError(path, f"unreadable ({' '.join(str(e).split())})") from None
    return weights


def source_dtype(config: dict, weights: dict) -> str:
    """The dtype the model is stored in: config.json's "dtype" (transformers 5) or
    "torch_dtype" (4), else the dtype most of its floating tensors have."""
    for key in ("dtype", "torch_dtype"):
        if config.get(key) in DTYPES:
            return config[key]
    counts: dict[str, int] = {}
    for t in weights.values():
        if t.is_floating_point():
            name = str(t.dtype).replace("torch.", "")
            counts[name] = counts.get(name, 0) + t.numel()
    return max(counts, key=counts.__getitem__) if counts else "float32"


# Buffers some checkpoints carry that are not parameters (old transformers versions).
_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def canonical_names(arch: str, weights: dict, tied: bool) -> dict:
    """Names as *ForCausalLM saves them: add the base-model prefix where a bare base model
    was saved, drop non-parameter buffers and the duplicate lm_head of a tied model."""
    prefix = base_prefix(arch)
    out = {}
    for name, t in weights.items():
        if name.endswith(_BUFFERS) or (tied and name == "lm_head.weight"):
            continue
        if not name.startswith(prefix) and name != "lm_head.weight":
            name = prefix + name
        out[name] = t
    return out


def state_from_hf(cfg, arch: str, weights: dict, where: str) -> dict:
    """Our state dict (fp32, like the trainer's master weights) from a family's tensors."""
    import torch
    links = links_for(cfg, arch)
    weights = canonical_names(arch, weights, not cfg.untie_embeddings_and_output_weights)
    extra = sorted(set(weights) - {link.hf for link in links})
    if extra:
        raise ConvertError(where, f"unexpected tensor {extra[0]} (not a parameter of "
                                  f"this model with its config.json)")
    shapes, state = our_shapes(cfg), {}
    for link in links:
        if link.hf not in weights:
            raise ConvertError(where, f"missing tensor {link.hf}")
        tensor = weights[link.hf]
        want = [list(shapes[name]) for name in link.ours]
        try:
            parts = from_hf_tensor(link, tensor, shapes)
        except RuntimeError:  # a fused tensor that does not split, a 1-D "weight"
            parts = {}
        if [list(parts.get(name, torch.empty(0)).shape) for name in link.ours] != want:
            raise ConvertError(where, f"{link.hf} has shape {list(tensor.shape)}, config.json "
                                      f"implies {' + '.join(map(str, want))} for our "
                                      f"{', '.join(link.ours)}")
        for name, t in parts.items():
            state[name] = t.float().contiguous()
    return state


# -- writing ----------------------------------------------------------------------------------

def shards(tensors: dict, max_bytes: int) -> list:
    """Consecutive groups of tensor names, each at most `max_bytes` unless one tensor alone
    is bigger (it gets a shard of its own), in the tensors' order."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def save_weights(tensors: dict, out: str, max_bytes: int) -> int:
    """model.safetensors, or shards and their index when over `max_bytes`; the file count."""
    from safetensors.torch import save_file
    groups = shards(tensors, max_bytes)
    if len(groups) == 1:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return 1
    weight_map = {}
    for i, names in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(out, name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                  sort_keys=True)
    return len(groups)
