"""`model.quantization`: what a checkpoint declares, and the one rule that turns a request into a weight format.

Names (vLLM's where it has them), the values of EngineConfig.quantization:
- auto: the checkpoint's declared `quantization_config` decides; none when it declares nothing
  (a GGUF file: dequantized to the engine dtype, as `none`).
- none: float weights in the engine dtype.
- fp8, int8, int4: quantize every linear layer at load (an FP8 checkpoint's `fp8` is read as stored).
- gptq, awq, compressed-tensors: integer checkpoints read as published (the folder must declare it).
- gguf: a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks kept as int8 / int4 groups of 32.
A value that disagrees with what a folder declares is refused with both named.
"""

from __future__ import annotations

from dataclasses import dataclass

AT_LOAD = ("fp8", "int8", "int4")  # quantized at load from float weights
INT_CHECKPOINTS = ("gptq", "awq", "compressed-tensors")  # integer checkpoints read as published
GPTQ_BITS = (4, 8)
CT_FORMATS = ("pack-quantized", "int-quantized")


@dataclass(frozen=True)
class DeclaredQuantization:
    """A folder's quantization_config, named: method is fp8 | gptq | awq | compressed-tensors."""

    method: str
    config: dict

    @property
    def bits(self) -> int:
        if self.method == "fp8":
            return 8
        if self.method == "compressed-tensors":
            return int(_ct_weights(self.config)["num_bits"])
        return int(self.config.get("bits", self.config.get("w_bit", 4)))

    @property
    def group_size(self) -> int:
        """Columns per group; -1 for one group per output channel."""
        if self.method == "compressed-tensors":
            weights = _ct_weights(self.config)
            return int(weights.get("group_size") or -1) if weights.get("strategy") == "group" else -1
        return int(self.config.get("group_size", self.config.get("q_group_size", -1)))

    @property
    def is_symmetric(self) -> bool:
        if self.method == "compressed-tensors":
            return bool(_ct_weights(self.config).get("symmetric", True))
        if self.method == "awq":
            return not self.config.get("zero_point", True)
        return bool(self.config.get("sym", True))

    @property
    def has_act_order(self) -> bool:
        if self.method == "compressed-tensors":
            return _ct_weights(self.config).get("actorder") not in (None, False, "static")
        return bool(self.config.get("desc_act", False))

    @property
    def is_lm_head_quantized(self) -> bool:
        return bool(self.config.get("lm_head", False))


def _ct_weights(qcfg: dict) -> dict:
    groups = qcfg.get("config_groups") or {}
    return next(iter(groups.values())).get("weights") or {}


def declared_quantization(hf_config: dict, where: str) -> DeclaredQuantization | None:
    """The folder's quantization_config when batchgen can read it; None when it declares none.

    Raises ValueError for methods and layouts batchgen does not read.
    """
    qcfg = hf_config.get("quantization_config")
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if method == "compressed-tensors" and _is_ct_float(qcfg):
        method = "fp8"
    if method == "fp8" and qcfg.get("weight_block_size"):
        from batchgen.engine.quant.fp8_block import fp8_block_size

        fp8_block_size(hf_config, where)  # checks the block size and format
        return None  # dequantized as its tensors stream in (quant/fp8_block.py): held in the model dtype
    if method == "mxfp4" and "GptOssForCausalLM" in (hf_config.get("architectures") or []):
        return None  # gpt-oss's experts as published: dequantized at load by its family (models/gpt_oss.py)
    if method == "fp8":
        from batchgen.engine.quant.fp8_checkpoint import fp8_quant_config

        fp8_quant_config(hf_config, where)  # refuses block-wise and other unsupported FP8 layouts
        return DeclaredQuantization("fp8", qcfg)
    if method == "gptq":
        _check_gptq(qcfg, where)
    elif method == "awq":
        _check_awq(qcfg, where)
    elif method == "compressed-tensors":
        _check_ct_int(qcfg, where)
    else:
        raise ValueError(f"{where}: quantization_config.quant_method {method!r} is not supported "
                         f"(fp8, {', '.join(INT_CHECKPOINTS)})")
    return DeclaredQuantization(method, qcfg)


def _is_ct_float(qcfg: dict) -> bool:
    groups = qcfg.get("config_groups") or {}
    return bool(groups) and all((g.get("weights") or {}).get("type") == "float" for g in groups.values())


def _check_gptq(qcfg: dict, where: str) -> None:
    bits = qcfg.get("bits")
    if bits not in GPTQ_BITS:
        raise ValueError(f"{where}: GPTQ bits {bits!r} are not supported (4 or 8)")
    fmt = qcfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")


def _check_awq(qcfg: dict, where: str) -> None:
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    version = str(qcfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(f"{where}: AWQ {bits}-bit version {version!r} is not supported (4-bit GEMM)")


def _check_ct_int(qcfg: dict, where: str) -> None:
    groups = qcfg.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}: compressed-tensors quantization_config has no config_groups")
    if len(groups) > 1:
        raise ValueError(f"{where}: compressed-tensors with {len(groups)} config_groups is not supported (one)")
    fmt = qcfg.get("format")
    if fmt not in CT_FORMATS:
        raise ValueError(f"{where}: compressed-tensors format {fmt!r} is not supported ({', '.join(CT_FORMATS)})")
    for name, group in groups.items():
        weights = group.get("weights") or {}
        if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
            raise ValueError(f"{where}: compressed-tensors group {name!r} has weights {weights}; "
                             "only 4- or 8-bit int (or 8-bit float) weights are read")
        if weights.get("strategy") not in ("group", "channel", "tensor"):
            raise ValueError(f"{where}: compressed-tensors strategy {weights.get('strategy')!r} in {name!r} is "
                             "not supported (group, channel, tensor)")
        if group.get("input_activations"):
            raise ValueError(f"{where}: compressed-tensors group {name!r} quantizes activations too "
                             "(W8A8 int); only weight-only integer checkpoints are read")


def resolve_quantization(requested: str, declared: DeclaredQuantization | None, *, is_gguf: bool,
                         where: str) -> str:
    """The weight format that loads: none | fp8 | int8 | int4 | gptq | awq | compressed-tensors | gguf.

    Raises ValueError naming both sides when `requested` conflicts with the checkpoint.
    """
    if is_gguf:
        if requested in INT_CHECKPOINTS:
            raise ValueError(f"model.quantization {requested} reads {requested} checkpoint folders; {where} is a "
                             "GGUF file (use gguf to keep its blocks, or none / auto to dequantize them)")
        return "none" if requested == "auto" else requested
    if requested == "gguf":
        raise ValueError(f"model.quantization gguf keeps a GGUF file's blocks; {where} is an HF folder")
    name = declared.method if declared else None
    if requested == "auto" or requested == name:
        return name or "none"
    if name is None:
        if requested in INT_CHECKPOINTS:
            raise ValueError(f"model.quantization {requested} conflicts with {where}, which declares no "
                             "quantization_config (use int8 / int4 to quantize at load)")
        return requested
    raise ValueError(f"model.quantization {requested} conflicts with {where}, whose quantization_config "
                     f"declares {name} (use auto or {name})")
