"""MXFP4 (OCP MX v1.0) quantization of a target in AMD Quark's format.

`eyas quantize --model DIR --out Q [--exclude PAT ...] [--activations none|mxfp4] [--emulate]`.
Numerics in `mxfp4` (checked byte for byte against torchao), checkpoint writing in
`quantize` (`quantize_model(QuantizeConfig) -> manifest dict`), MXFP4-vs-bf16 quality and
quantizer speed in `bench` (`run_bench`).
"""

from __future__ import annotations

from typing import Any


def cli(cfg, actions: list[str]) -> int:
    """`eyas quantize`: cfg is the resolved Recipe, cfg.quantize a QuantizeConfig."""
    from eyas.quant.quantize import cli_main

    return cli_main(cfg, actions)


def quantize_model(cfg, log=print) -> dict[str, Any]:
    """See `eyas.quant.quantize.quantize_model` (imported lazily: torch, safetensors)."""
    from eyas.quant.quantize import quantize_model as run

    return run(cfg, log=log)
