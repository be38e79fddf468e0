"""Integer weight formats: checkpoint readers (GPTQ, AWQ, compressed-tensors) and round-to-nearest
quantizers, all producing one IntWeight that the weight-only linear layers consume."""

from batchgen.engine.quant.int_formats.awq import read_awq
from batchgen.engine.quant.int_formats.compressed_tensors import read_int_quantized, read_pack_quantized
from batchgen.engine.quant.int_formats.gptq import read_gptq
from batchgen.engine.quant.int_formats.int_weight import IntWeight, unpack_int32
from batchgen.engine.quant.int_formats.rtn import quantize_int4_groups, quantize_int8_per_channel

__all__ = ["IntWeight", "quantize_int4_groups", "quantize_int8_per_channel", "read_awq", "read_gptq",
           "read_int_quantized", "read_pack_quantized", "unpack_int32"]
