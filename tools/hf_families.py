"""The Hugging Face model families the converter writes and reads, what each can hold,
and their config.json and weight names (the table is in convert_checkpoint.py's --help).

  --arch    class                 what it holds beyond a plain Llama
  llama     LlamaForCausalLM      biases on every linear or none (attention_bias = mlp_bias)
  mistral   MistralForCausalLM    a sliding window (sliding_window); no biases
  qwen2     Qwen2ForCausalLM      biases on q, k and v only; a sliding window
  qwen3     Qwen3ForCausalLM      per-head q and k RMSNorm (q_norm, k_norm); a sliding window
  gpt2      GPT2LMHeadModel       learned positions, LayerNorm, GeLU, biases everywhere

The four RoPE families take every RoPE scaling (hf_rope.py) and any head dimension
(head_dim). A feature of ours that a family cannot hold is refused with the flag that
made it, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hf_errors import ConvertError
from hf_rope import rope_from_hf, rope_to_hf

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gpt2": "GPT2LMHeadModel"}
ROPE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
_CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                 "qwen3": "Qwen3Config", "gpt2": "GPT2Config"}
_TITLE = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
          "gpt2": "GPT-2"}


def family_of(architecture: Optional[str]) -> Optional[str]:
    """Our --arch name of a Hugging Face class name (None for an unknown one)."""
    return next((k for k, v in FAMILIES.items() if v == architecture), None)


# -- ours -> a family: what it cannot hold ----------------------------------------------------

def _rope_rules(c, arch: str, window: Optional[int]) -> list:
    """(ok, flag, rule) for a RoPE family."""
    name = _TITLE[arch]
    rules = [(c.position_embedding_type == "rope",
              f"--position-embedding-type {c.position_embedding_type}", f"{name} has rope"),
             (c.normalization == "RMSNorm", f"--normalization {c.normalization}",
              f"{name} has RMSNorm"),
             (c.swiglu, "--no-swiglu", f"{name} has a SwiGLU MLP"),
             (c.hidden_size % c.num_attention_heads == 0, f"--hidden-size {c.hidden_size}",
              f"transformers needs it divisible by the {c.num_attention_heads} heads")]
    qkv_only = c.add_qkv_bias and not c.add_bias_linear
    if arch == "llama":
        rules.append((not qkv_only, "--add-qkv-bias", "Llama has biases on q, k, v and o "
                      "or none (Qwen2 has q, k, v only)"))
    elif arch == "qwen2":
        rules.append((qkv_only, "--add-bias-linear" if c.add_bias_linear else
                      "--disable-bias-linear without --add-qkv-bias",
                      "Qwen2 has biases on q, k and v only (--disable-bias-linear "
                      "--add-qkv-bias)"))
    else:
        rules.append((not (c.add_bias_linear or c.add_qkv_bias),
                      "--add-bias-linear" if c.add_bias_linear else "--add-qkv-bias",
                      "Mistral has no biases" if arch == "mistral" else
                      "Qwen3 has biases on q, k, v and o (attention_bias) or none"))
    if arch == "qwen3":
        rules.append((c.qk_layernorm, "without --qk-layernorm",
                      "Qwen3 normalizes each head of q and k"))
    else:
        rules.append((not c.qk_layernorm, "--qk-layernorm", f"{name} has no q/k norm "
                      "(Qwen3 has)"))
    if arch == "llama":
        rules.append((window is None, f"--window-size {window}", "Llama has no sliding "
                      "window (Mistral, Qwen2 and Qwen3 have)"))
    return rules


def _gpt2_rules(c, window: Optional[int]) -> list:
    return [(c.position_embedding_type == "learned_absolute",
             f"--position-embedding-type {c.position_embedding_type}",
             "GPT-2 has learned_absolute positions"),
            (c.normalization == "LayerNorm", f"--normalization {c.normalization}",
             "GPT-2 has LayerNorm"),
            (not c.swiglu, "--swiglu", "GPT-2 has a GeLU MLP"),
            (c.add_bias_linear, "--disable-bias-linear", "GPT-2 has biases on every linear"),
            (c.num_kv_heads == c.num_attention_heads, f"--num-query-groups {c.num_kv_heads}",
             f"GPT-2 has no grouped-query attention (kv heads = the "
             f"{c.num_attention_heads} heads)"),
            (c.head_dim * c.num_attention_heads == c.hidden_size,
             f"--kv-channels {c.head_dim}", "GPT-2's head dimension is hidden / heads"),
            (not c.qk_layernorm, "--qk-layernorm", "GPT-2 has no q/k norm"),
            (window is None, f"--window-size {window}", "GPT-2 has no sliding window")]


def export_problems(cfg, arch: str, mask: dict) -> list:
    """"<flag>: <rule>" for every setting of the checkpoint `arch` cannot hold. `mask`:
    the run's attention mask settings (window_size, attention_sparsity)."""
    window = mask.get("window_size")
    rules = _gpt2_rules(cfg, window) if arch == "gpt2" else _rope_rules(cfg, arch, window)
    sparsity = mask.get("attention_sparsity") or "dense"
    rules.append((sparsity == "dense", f"--attention-sparsity {sparsity}",
                  "no Hugging Face model has block-sparse attention"))
    return [f"{flag}: {rule}" for ok, flag, rule in rules if not ok]


def check_exportable(cfg, arch: str, mask: dict) -> None:
    broken = export_problems(cfg, arch, mask)
    if broken:  # every reason at once, on one line
        raise ConvertError("--arch", f"{arch}: the checkpoint cannot be a {FAMILIES[arch]}: "
                                     + "; ".join(broken))


def pick_arch(cfg, asked: str, mask: dict, recorded: Optional[str] = None) -> str:
    """--arch NAME as asked; auto: the family from-hf recorded when it can hold the model,
    else the one its features need."""
    if asked == "auto":
        if recorded in FAMILIES and not export_problems(cfg, recorded, mask):
            return recorded
        if cfg.qk_layernorm:
            asked = "qwen3"
        elif cfg.add_qkv_bias and not cfg.add_bias_linear:
            asked = "qwen2"
        elif mask.get("window_size") is not None:
            asked = "mistral"
        else:
            asked = "llama" if cfg.position_embedding_type == "rope" else "gpt2"
    check_exportable(cfg, asked, mask)
    return asked


# -- the weight names, one table for both directions --------------------------------------

@dataclass(frozen=True)
class Link:
    """One Hugging Face tensor and the parameter(s) of ours it holds.

    kind: "same" (a rename), "t" (GPT-2 Conv1D: transposed), "fused_t" (GPT-2 c_attn
    weight: q, k, v stacked by output rows, then transposed), "fused" (c_attn bias), "1p"
    (a norm weight of an --apply-layernorm-1p model, which stores gamma - 1: gamma is
    weight + 1)."""
    hf: str
    ours: tuple
    kind: str = "same"


def _pair(hf: str, ours: str, kind: str, bias: bool) -> list:
    out = [Link(hf + ".weight", (ours + ".weight",), kind)]
    if bias:
        out.append(Link(hf + ".bias", (ours + ".bias",)))
    return out


def _norm_kind(cfg) -> str:
    return "1p" if cfg.apply_layernorm_1p else "same"


def _rope_layer_links(cfg, i: int) -> list:
    b, norm = cfg.add_bias_linear, _norm_kind(cfg)
    hf, us = f"model.layers.{i}.", f"layers.{i}."
    links = _pair(hf + "input_layernorm", us + "attn_norm", norm, False)
    for theirs, ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
        links += _pair(f"{hf}self_attn.{theirs}", f"{us}attn.{ours}", "same",
                       b or cfg.add_qkv_bias)
    links += _pair(f"{hf}self_attn.o_proj", f"{us}attn.out", "same", b)
    if cfg.qk_layernorm:  # Qwen3: [head_dim] weights shared by the heads
        links += _pair(f"{hf}self_attn.q_norm", f"{us}attn.q_norm", norm, False)
        links += _pair(f"{hf}self_attn.k_norm", f"{us}attn.k_norm", norm, False)
    links += _pair(hf + "post_attention_layernorm", us + "mlp_norm", norm, False)
    for theirs, ours in (("gate_proj", "gate"), ("up_proj", "fc1"), ("down_proj", "fc2")):
        links += _pair(f"{hf}mlp.{theirs}", f"{us}mlp.{ours}", "same", b)
    return links


def rope_family_links(cfg) -> list:
    """Llama, Mistral, Qwen2 and Qwen3 name their tensors alike."""
    links = [Link("model.embed_tokens.weight", ("embed.word.weight",))]
    for i in range(cfg.num_layers):
        links += _rope_layer_links(cfg, i)
    links += _pair("model.norm", "head.norm", _norm_kind(cfg), False)
    if cfg.untie_embeddings_and_output_weights:
        links.append(Link("lm_head.weight", ("head.output.weight",)))
    return links


def gpt2_links(cfg) -> list:
    norm = _norm_kind(cfg)
    links = [Link("transformer.wte.weight", ("embed.word.weight",)),
             Link("transformer.wpe.weight", ("embed.position.weight",))]
    for i in range(cfg.num_layers):
        hf, us = f"transformer.h.{i}.", f"layers.{i}."
        qkv = tuple(f"{us}attn.{x}" for x in "qkv")
        links += _pair(hf + "ln_1", us + "attn_norm", norm, True)
        links += [Link(hf + "attn.c_attn.weight", tuple(n + ".weight" for n in qkv), "fused_t"),
                  Link(hf + "attn.c_attn.bias", tuple(n + ".bias" for n in qkv), "fused")]
        links += _pair(hf + "attn.c_proj", us + "attn.out", "t", True)
        links += _pair(hf + "ln_2", us + "mlp_norm", norm, True)
        links += _pair(hf + "mlp.c_fc", us + "mlp.fc1", "t", True)
        links += _pair(hf + "mlp.c_proj", us + "mlp.fc2", "t", True)
    links += _pair("transformer.ln_f", "head.norm", norm, True)
    if cfg.untie_embeddings_and_output_weights:
        links.append(Link("lm_head.weight", ("head.output.weight",)))
    return links


def links_for(cfg, arch: str) -> list:
    return gpt2_links(cfg) if arch == "gpt2" else rope_family_links(cfg)


def base_prefix(arch: str) -> str:
    """The base model's attribute in *ForCausalLM, as tensor names start with it."""
    return "transformer." if arch == "gpt2" else "model."


# -- ours -> a family's config.json -----------------------------------------------------------

def hf_config(cfg, arch: str, run: dict, common: dict, window: Optional[int]):
    """The transformers config of family `arch` for our ModelConfig `cfg`. `run`: the
    training run's model flags (dropouts), `common`: the keys every family shares."""
    import transformers
    make = getattr(transformers, _CONFIG_CLASS[arch])
    if arch == "gpt2":
        dropout = run.get("hidden_dropout", 0.0)
        return make(n_embd=cfg.hidden_size, n_inner=cfg.ffn_size, n_layer=cfg.num_layers,
                    n_head=cfg.num_attention_heads, n_positions=cfg.max_positions,
                    activation_function="gelu_new" if cfg.gelu_approximate == "tanh" else "gelu",
                    layer_norm_epsilon=cfg.norm_epsilon,
                    resid_pdrop=dropout, embd_pdrop=dropout,
                    attn_pdrop=run.get("attention_dropout", 0.0), **common)
    keys = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.norm_epsilon,
                rope_parameters=rope_to_hf(cfg),
                attention_dropout=run.get("attention_dropout", 0.0), **common)
    if arch == "llama":
        keys.update(attention_bias=cfg.add_bias_linear, mlp_bias=cfg.add_bias_linear)
    elif arch == "mistral":
        keys.update(sliding_window=window)
    elif window is None:
        keys.update(use_sliding_window=False, sliding_window=None)
    else:  # Qwen: a window on every layer is one from layer 0 on
        keys.update(use_sliding_window=True, sliding_window=window, max_window_layers=0)
    if arch == "qwen3":
        keys.update(attention_bias=False)
    if arch == "qwen2" and cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size:
        del keys["head_dim"]  # not a Qwen2Config key: written only where it must be
    return make(**keys)


# -- a family's config.json -> ours -----------------------------------------------------------

def read_family_config(arch: str, hf_dir: str):
    import transformers
    return getattr(transformers, _CONFIG_CLASS[arch]).from_pretrained(hf_dir)


def _window(arch: str, c, path: str) -> Optional[int]:
    """The sliding window every layer has (None: full causal attention)."""
    if arch == "mistral":
        return c.sliding_window
    if arch not in ("qwen2", "qwen3"):
        return None
    types = set(getattr(c, "layer_types", None) or ["full_attention"])
    if types == {"full_attention"}:
        return None
    if types == {"sliding_attention"}:
        return c.sliding_window
    raise ConvertError(path, f"layer_types {sorted(types)} (use_sliding_window with "
                             f"max_window_layers {c.max_window_layers}): a sliding window on "
                             "some layers only; our --window-size applies to every layer")


def _rope_family_rules(arch: str, c) -> list:
    rules = [(c.hidden_act == "silu", "hidden_act", f"{c.hidden_act!r}: only silu (SwiGLU)")]
    if arch == "llama":
        rules.append((c.attention_bias == c.mlp_bias, "mlp_bias",
                      f"{c.mlp_bias} differs from attention_bias {c.attention_bias}: our "
                      "linears have biases all or none (--add-bias-linear), or on q, k, v "
                      "only (--add-qkv-bias)"))
    if arch == "qwen3":
        rules.append((not c.attention_bias, "attention_bias", "true puts a bias on o_proj "
                      "too while the MLP has none: our linears have biases all or none, or "
                      "on q, k, v only"))
    return rules


# transformers' names of the tanh-approximated GeLU (Megatron-LM's fused bias-GeLU's math)
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _gpt2_import_rules(c) -> list:
    act = c.activation_function
    return [(act in TANH_GELUS + ("gelu",), "activation_function",
             f"{act!r}: only the tanh GeLU (gelu_new) or the exact one (gelu)"),
            (c.scale_attn_weights and not c.scale_attn_by_inverse_layer_idx,
             "scale_attn_weights", "only 1/sqrt(head_dim) attention scaling"),
            (not c.add_cross_attention, "add_cross_attention", "not a decoder-only model")]


def _rope_family_shape(arch: str, c, path: str, rope_key: str) -> dict:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConvertError(path, f"{rope_key}: RoPE settings per layer type are not supported")
    return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                ffn_hidden_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                num_query_groups=c.num_key_value_heads,
                kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                max_position_embeddings=c.max_position_embeddings,
                position_embedding_type="rope", normalization="RMSNorm",
                norm_epsilon=c.rms_norm_eps, swiglu=True,
                add_bias_linear=bool(arch == "llama" and c.attention_bias),
                add_qkv_bias=arch == "qwen2", qk_layernorm=arch == "qwen3",
                **rope_from_hf(rope, c.max_position_embeddings, path, rope_key))


def model_fields_from_hf(arch: str, c, path: str, rope_key: str) -> tuple:
    """(our ModelConfig's shape fields, the sliding window or None) of the transformers
    config `c` of family `arch`; ConvertError naming config.json's key otherwise."""
    rules = _gpt2_import_rules(c) if arch == "gpt2" else _rope_family_rules(arch, c)
    for ok, key, rule in rules:
        if not ok:
            raise ConvertError(path, f"{key}: {rule}")
    if arch != "gpt2":
        return _rope_family_shape(arch, c, path, rope_key), _window(arch, c, path)
    return dict(num_layers=c.n_layer, hidden_size=c.n_embd,
                ffn_hidden_size=c.n_inner or 4 * c.n_embd, num_attention_heads=c.n_head,
                num_query_groups=c.n_head, kv_channels=c.n_embd // c.n_head,
                max_position_embeddings=c.n_positions,
                position_embedding_type="learned_absolute", normalization="LayerNorm",
                norm_epsilon=c.layer_norm_epsilon, swiglu=False, add_bias_linear=True,
                bias_gelu_fusion=c.activation_function in TANH_GELUS), None
