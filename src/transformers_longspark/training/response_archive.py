"""Compressed archives of the target's regenerated responses, so that a regeneration is paid for once.

A regeneration run can take hours of CPU; its records (see :mod:`.regenerate`) hold prompts from downloaded corpora
and the target's responses. An archive keeps only what the target wrote: one xz-compressed JSON line per record,
``{"run": <hash of the run settings>, "id": 17, "response_ids": [...]}``, after a first line that maps each hash to
the settings of the run (target, engine, dtype, prompt-list hash, seed, sampling). ``longspark regenerate
--archives DIR`` rebuilds every archived record of a run with the same settings (prompt from the corpus, response
from the archive) instead of sampling it again, and ``longspark pack DATA_DIR DIR`` adds the records that the
archives in ``DIR`` lack as one new file, so a folder of archives can be committed and grown one file at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT = "longspark-responses/1"
ARCHIVE_GLOB = "responses-*.jsonl.xz"


def run_key(config: Mapping[str, Any]) -> str:
    """A short stable hash of a run's settings (the ``regenerate_config.json`` of a data folder)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def archived_responses(archive_dir: str | os.PathLike, config: Mapping[str, Any]) -> dict[int, list[int]]:
    """``{record id: response ids}`` of every archived record sampled with exactly these run settings."""
    if not Path(archive_dir).is_dir():
        raise FileNotFoundError(f"No archive folder at {archive_dir}; pass the folder `longspark pack` wrote to.")
    key, found = run_key(config), {}
    for path in sorted(Path(archive_dir).glob(ARCHIVE_GLOB)):
        for record in _read_archive(path):
            if record["run"] == key:
                found[record["id"]] = record["response_ids"]
    return found


def pack_responses(data_dir: str | os.PathLike, archive_dir: str | os.PathLike) -> Path | None:
    """Writes the responses of ``data_dir`` (a regenerated folder, or one with ``train/`` and ``held_out/``) that
    the archives of ``archive_dir`` lack into a new archive there. Safe while a regeneration still writes to
    ``data_dir`` (a half-written last line is left out). Returns the new file, or ``None`` if nothing was new."""
    data, archive = Path(data_dir), Path(archive_dir)
    folders = [folder for folder in (data, data / "held_out", data / "train") if (folder / _CONFIG).exists()]
    if not folders:
        raise FileNotFoundError(f"{data} holds no regenerated records ({_CONFIG}); pass the --output of regenerate.")
    runs: dict[str, dict[str, Any]] = {}
    new: list[dict[str, Any]] = []
    for folder in folders:
        config = json.loads((folder / _CONFIG).read_text())
        key = run_key(config)
        known = archived_responses(archive, config) if archive.is_dir() else {}
        fresh = [record for record in _complete_records(folder) if record["id"] not in known]
        if fresh:
            runs[key] = config
            new += [{"run": key, "id": r["id"], "response_ids": r["response_ids"]} for r in fresh]
    if not new:
        return None
    archive.mkdir(parents=True, exist_ok=True)
    numbers = [int(path.name[10:-9]) for path in archive.glob(ARCHIVE_GLOB) if path.name[10:-9].isdigit()]
    path = archive / f"responses-{max(numbers, default=-1) + 1:03d}.jsonl.xz"
    lines = [{"format": FORMAT, "runs": runs}, *sorted(new, key=lambda r: (r["run"], r["id"]))]
    with lzma.open(path.with_suffix(".tmp"), "wt", encoding="utf-8", preset=9) as file:
        file.writelines(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    path.with_suffix(".tmp").replace(path)
    logger.info("%s: %d responses of %d run(s)", path, len(new), len(runs))
    return path


_CONFIG = "regenerate_config.json"  # regenerate.CONFIG_FILE (that module imports torch)


def _read_archive(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one archive, after checking its header (whose run settings are for readers of the file)."""
    with lzma.open(path, "rt", encoding="utf-8") as file:
        lines = file.read().splitlines()
    header = json.loads(lines[0]) if lines else {}
    if header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a response archive ({FORMAT}); remove it from the archive folder.")
    return (json.loads(line) for line in lines[1:])


def _complete_records(folder: Path) -> Iterator[dict[str, Any]]:
    """The records of ``folder``'s shards, leaving out a half-written last line without touching the file."""
    for shard in sorted(folder.glob("part-*.jsonl")):
        data = shard.read_bytes()
        for line in data[: data.rfind(b"\n") + 1].splitlines():
            yield json.loads(line)
