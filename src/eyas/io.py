"""Files every stage writes and reads: atomic text, JSONL (written atomically, appended
durably, read strictly), JSON. Nothing here knows a stage.

    atomic_path(path)               a temp path beside `path` to write; fsynced and renamed over it on success
    write_error(e, path)            the OSError behind a failed write (safetensors', torch's too), naming `path`
    atomic_write_text(path, text)   the same for text: a kill leaves the old file or the new one
    write_jsonl(path, records)      the same for a whole JSONL file
    append_jsonl(path, records)     append + fsync: what returned survives a crash right after
    read_text(path)                 a UTF-8 text file; other bytes are a ValueError naming file:line
    iter_jsonl(path, hint, on_bad)  (line_no, object) of every non-blank line; a bad line is a ValueError
                                    naming file:line, or, with `on_bad`, reported to it and skipped
    scan_jsonl(path)                records of a file this process appends to, a torn last line cut off
    open_safetensors(path, fix)     safetensors' safe_open; a missing, torn or foreign file is a ValueError
    load_safetensors(path, fix)     naming it and `fix` (load_file likewise)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from eyas.faults import fail, failpoint, hit


def plain_mode(path: str | os.PathLike) -> None:
    """Give a file the mode a plain `open(..., "w")` would (0666 less the umask): safetensors and
    mkstemp write 0600, which keeps other users from serving or reading what eyas made."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path` (`.NAME.tmp.PID`) for the caller to write. When the block
    ends, the file is made readable as a plain file would be (0666 less the umask: safetensors
    writes 0600), fsynced and renamed over `path`; when it raises, the temp file is removed and a
    failed write (a full disk, a read-only dir) is an OSError naming `path` (`write_error`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        yield tmp
        plain_mode(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        failpoint("write.before_rename", path)
        os.replace(tmp, path)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        err = write_error(e, path, tmp)
        if err is not None and err is not e:
            raise err from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_OS_ERROR_IN_TEXT = re.compile(r"os error (\d+)")  # how safetensors (Rust) words an I/O error


def write_error(e: BaseException, path: str | os.PathLike, tmp: str | os.PathLike | None = None) -> OSError | None:
    """The OSError behind a failed write of `path`, named by `path`; None when `e` is not one.

    Python's own write errors often carry no file name (`open` worked, `write` did not); safetensors
    raises a SafetensorError with the errno in its text; torch.distributed.checkpoint wraps its
    writers' errors in a CheckpointException, and torch's zip writer on a full disk says only
    "unexpected pos": that is read as ENOSPC when the disk holding `path` has under 1 MiB free."""
    if isinstance(e, OSError):
        if e.errno is not None and (e.filename is None or (tmp is not None and e.filename == str(tmp))):
            return OSError(e.errno, e.strerror or os.strerror(e.errno), str(path))
        return e
    for inner in [x[0] for x in getattr(e, "failures", {}).values() if isinstance(x, tuple) and x] or [e]:
        if isinstance(inner, OSError) and inner.errno is not None:
            return write_error(inner, path, tmp)
        if m := _OS_ERROR_IN_TEXT.search(str(inner)):
            code = int(m.group(1))
            return OSError(code, os.strerror(code), str(path))
        if "unexpected pos" in str(inner) and _free_bytes(path) < 1 << 20:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def _free_bytes(path: str | os.PathLike) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 1 << 62


def remove_temp_files(d: str | os.PathLike) -> list[str]:
    """Remove the temp files killed atomic writes (`atomic_path`) left directly in `d`: files named
    `.NAME.tmp.PID` (files, or links as checkpoints/best's), nothing else; their names. Only for a dir
    no other eyas process is writing."""
    gone = []
    for p in Path(d).glob(".*.tmp.*"):
        if (p.is_symlink() or p.is_file()) and p.name.rsplit(".tmp.", 1)[1].isdigit():
            p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so that a kill leaves either the old file or the new one."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Atomic like `atomic_write_text`, streamed. Returns the record count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            n += 1
    return n


def append_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    """Append records and fsync: what is appended survives a crash right after. A failed write (a full
    disk) cuts the file back to where it was and raises an OSError naming it (`write_error`)."""
    if not records:
        return
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        if (mode := hit("append.torn")) is not None:
            cut = len(data) // 2
            cut -= data[cut - 1 : cut] == b"\n"  # mid-line, never at a line's end
            _write_all(fd, data[:cut])
            fail(mode, path)
        _write_all(fd, data)
        os.fsync(fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)  # what was complete before stays complete: no torn line left
        raise write_error(e, path) from None
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def iter_jsonl(path: str | os.PathLike, missing_hint: str = "",
               on_bad: Callable[[int, str], None] | None = None) -> Iterator[tuple[int, Any]]:
    """Yield `(line_no, object)`; a missing file or a bad line is a ValueError naming file:line
    (with `on_bad`, a bad line is passed to it as (line_no, error) and skipped)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist" + (f" ({missing_hint})" if missing_hint else ""))
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                if on_bad is None:
                    raise ValueError(f"{p}:{n}: not JSON ({e}); fix or delete that line") from None
                on_bad(n, str(e))
                continue
            yield n, rec


def scan_jsonl(path: str | os.PathLike, who: str = "eyas") -> list[dict[str, Any]]:
    """Records of a JSONL file this stage appends to; a torn last line (a kill mid-write) is cut off.

    A bad line anywhere but at the end is a ValueError: that is not a torn write."""
    path = Path(path)
    recs: list[dict[str, Any]] = []
    if not path.exists():
        return recs
    good = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line) if line.endswith(b"\n") else None
            except json.JSONDecodeError:
                rec = None
            if rec is None:
                if f.read().strip():
                    raise ValueError(f"{path}: corrupt line at byte {good}, not at the end; delete the file to redo")
                break
            good += len(line)
            recs.append(rec)
    if good < path.stat().st_size:
        print(f"{who}: {path}: cutting off a partial last line ({path.stat().st_size - good} bytes) "
              "left by an interrupted run", file=sys.stderr)
        os.truncate(path, good)
    return recs


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file the user gave; bytes that are not UTF-8 are a ValueError naming the file and where."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None


def read_json(path: str | os.PathLike, what: str = "") -> dict[str, Any]:
    """A JSON object from `path`; missing or corrupt is a ValueError naming the file."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist" + (f" ({what})" if what else ""))
    try:
        return json.loads(read_text(p))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None


def _unreadable(path: str | os.PathLike, e: Exception, fix: str) -> ValueError:
    return ValueError(f"{path}: not a readable safetensors file ({e})" + (f"; {fix}" if fix else ""))


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike, fix: str = "") -> Iterator[Any]:
    """`safe_open(path, framework="pt")`; its errors (missing, truncated, not safetensors), here or while
    reading inside the block, are a ValueError naming the file and `fix`."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e, fix) from None
    with f:
        try:
            yield f
        except SafetensorError as e:
            raise _unreadable(path, e, fix) from None


def load_safetensors(path: str | os.PathLike, fix: str = "") -> dict[str, Any]:
    """`safetensors.torch.load_file(path)` with the errors of `open_safetensors`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e, fix) from None
