"""`eyas <stage>`: one subcommand per pipeline stage, plus `run` and `config`.

Every stage subcommand takes `--recipe NAME|FILE`, a `--flag` for each field of its
config section (`--max-tokens` sets `synth.max_tokens`), positional actions where the
stage has them (`eyas models fetch NAME`), and `section.key=value` overrides. Stage
modules are imported only when their command runs, so `eyas --help` stays instant.

Errors: a user's mistake (bad input, a file or dir that cannot be read or written, a busy
port) is one line naming the file or field and the fix, exit 2; anything else is eyas's own
bug: its traceback, said to be one, exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import sys
import traceback
import typing

from eyas import config as C
from eyas.children import start_watchdog
from eyas.vllm_fixes import set_target_options

# subcommand -> (its config section, the sections its entry takes, "module:function", help).
# A stage's entry is called as fn(*sections, actions, run): its own typed section(s), the
# positional actions and the run's shared section. None: the entry joins every stage and
# takes the whole Recipe (`eyas run`, `eyas bench`).
STAGES: dict[str, tuple[str, tuple[str, ...] | None, str, str]] = {
    "models": ("models", ("models",), "eyas.models:cli", "fetch / locate a target model (`models fetch|path NAME`)"),
    "data": ("data", ("data",), "eyas.data:cli", "fetch prompt data, show stats (`data fetch NAME...|stats FILE`)"),
    "synth": ("synth", ("synth",), "eyas.synth:cli",
              "stage 1: on-policy synthesis of assistant turns by the target in vLLM"),
    "extract": ("extract", ("extract",), "eyas.extract:cli",
                "stage 2: hidden-state extraction (offline / online / streaming)"),
    "train": ("train", ("train", "eval"), "eyas.serve_eval:train_cli",
              "stage 3: cold-start FSDP2 training of the EAGLE-3 head (TTT loss), serve-evaluated with eval.*"),
    "eval": ("eval", ("eval",), "eyas.evaluate:cli", "stage 4: true acceptance length under vLLM speculative decoding"),
    "export": ("export", ("export", "eval"), "eyas.export:cli",
               "stage 5: export a vLLM-ready draft (bf16 / fp8, vllm / speculators)"),
    "quantize": ("quantize", ("quantize",), "eyas.quant:cli", "MXFP4 (OCP MX) quantization of the target in Quark's format"),
    "bench": ("bench", None, "eyas.bench:cli", "benchmarks (`bench al|throughput|extract|train|quant|drift|threads|simulated|levers|curve|rules|synth`)"),
    "run": ("run", None, "eyas.pipeline:cli", "all stages end to end (the demo pipeline)"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_section_flags(p: argparse.ArgumentParser, section: str) -> None:
    cls = C.SECTIONS[section]
    hints = typing.get_type_hints(cls)
    for (sec, key), (to_sec, to_key) in C.ALIASES.items():  # moved keys keep their flags
        if sec == section:
            p.add_argument(_flag(key), dest=f"cfg__{key}", default=None, help=f"{to_sec}.{to_key} (moved there)")
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        doc = f"{section}.{f.name} (default: {f.default if f.default is not dataclasses.MISSING else f.default_factory()})"  # type: ignore[misc]
        if tp is bool:
            p.add_argument(_flag(f.name), dest=f"cfg__{f.name}", action=argparse.BooleanOptionalAction, default=None, help=doc)
        elif typing.get_origin(tp) is typing.Literal:
            p.add_argument(_flag(f.name), dest=f"cfg__{f.name}", choices=typing.get_args(tp), default=None, help=doc)
        elif typing.get_origin(tp) is list:
            p.add_argument(_flag(f.name), dest=f"cfg__{f.name}", nargs="+", default=None, help=doc)
        else:
            p.add_argument(_flag(f.name), dest=f"cfg__{f.name}", default=None, help=doc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eyas", description="Train EAGLE-3 draft heads with vLLM in the loop.")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    for name, (section, _, _, help_) in STAGES.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--recipe", default=None, help="recipe name under recipes/ or a YAML path")
        _add_section_flags(p, section)
        p.add_argument("rest", nargs="*", metavar="ACTION|section.key=value", help="actions and config overrides")
    p = sub.add_parser("config", help="print the resolved config (recipe + overrides) as YAML")
    p.add_argument("--recipe", default=None)
    p.add_argument("--section", default=None, help="print one section only")
    p.add_argument("rest", nargs="*", metavar="section.key=value")
    return parser


def resolve(args: argparse.Namespace, section: str | None) -> tuple[C.Recipe, list[str]]:
    """Recipe, then flags of the command's own section, then `key=value` overrides."""
    overrides = [r for r in args.rest if "=" in r]
    actions = [r for r in args.rest if "=" not in r]
    cfg = C.read_recipe(args.recipe)
    if section is not None:
        values = {k[5:]: v for k, v in vars(args).items() if k.startswith("cfg__") and v is not None}
        C.set_values(cfg, section, values, f"--flags of {section}")
    for ov in overrides:
        C.apply_override(cfg, ov, default_section=section)
    return C.finalize(cfg), actions


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if not a.startswith("-")]  # actions / overrides after the flags
    if len(late) != len(extra):
        parser.error(f"unrecognized arguments: {' '.join(a for a in extra if a.startswith('-'))}")
    args.rest = list(args.rest) + late
    try:
        if args.command == "config":
            cfg, actions = resolve(args, None)
            if actions:
                raise ValueError(f"eyas config takes overrides only (section.key=value), got {actions}")
            if args.section and args.section not in C.SECTIONS:
                raise ValueError(f"unknown section {args.section!r}; valid sections: {', '.join(C.SECTIONS)}")
            print(C.dump_yaml(getattr(cfg, args.section) if args.section else cfg), end="")
            return 0
        section, takes, target, _ = STAGES[args.command]
        cfg, actions = resolve(args, section)
        set_target_options(cfg.run.trust_remote_code, cfg.run.language_model_only)  # every engine started
        start_watchdog()  # engines and ranks this command starts die with it (eyas.children)
        module, func = target.split(":")
        entry = getattr(importlib.import_module(module), func)
        if takes is None:
            return int(entry(cfg, actions) or 0)
        return int(entry(*(getattr(cfg, t) for t in takes), actions, cfg.run) or 0)
    except ValueError as e:
        print(f"eyas {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"eyas {args.command}: error: {os_error_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"eyas {args.command}: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - not the user's input: eyas's own bug
        traceback.print_exc()
        print(f"eyas {args.command}: this is a bug in eyas, not in your input; please report it with the "
              "traceback above and the command line", file=sys.stderr)
        return 1


# what the user can do about an OSError, by errno
_OS_FIX = {
    errno.EACCES: "check its permissions, or choose another --out; the same command then resumes",
    errno.EPERM: "check its permissions, or choose another --out; the same command then resumes",
    errno.EROFS: "it is on a read-only file system: choose another --out",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EISDIR: "it is a directory where a file is expected: check the path",
    errno.ENOSPC: "the disk is full: free space and run the same command again to resume, or choose another --out",
    errno.EDQUOT: "the disk quota is used up: free space and run the same command again to resume",
    errno.EADDRINUSE: "the port is in use: choose another port",
}


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the file it names, what went wrong, what to do."""
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e)
    fix = _OS_FIX.get(e.errno or -1)
    return f"{where}{what}" + (f" ({fix})" if fix else "")


if __name__ == "__main__":
    sys.exit(main())
