"""MXFP4 (OCP MX v1.0) quantization of a target in AMD Quark's format.

`eyas quantize --model DIR --out Q [--exclude PAT ...] [--activations none|mxfp4] [--emulate]`.
Numerics in `mxfp4` (checked byte for byte against torchao), checkpoint writing in
`quantize` (`quantize_model(QuantizeConfig) -> manifest dict`); MXFP4-vs-bf16 quality and
quantizer speed are `eyas bench quant` (`eyas.bench.quant`).
"""

from __future__ import annotations

from eyas.quant.quantize import cli, quantize_model

__all__ = ["cli", "quantize_model"]
