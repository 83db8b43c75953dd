"""Carry a model directory to a device machine in pieces: split it into chunk files, join and verify them there.

    python benchmarks/gpu_model_chunks.py split [MODEL_DIR] [--into runs/gpu-model-chunks] [--chunk-mb 30]
    python benchmarks/gpu_model_chunks.py join [--from runs/gpu-model-chunks] --to runs/gpu-model

A device call carries the working tree plus at most 64 MiB of ignored paths (the repository itself is about
23 MB of it), and a machine left idle is handed back with what it held. SmolLM2-135M-Instruct's cached bf16
``model.safetensors`` is 269,060,552 bytes (tokenizer, config and chat template: 3.5 MB more): at 30 MB a
chunk it is 10 chunk files, so about 10 device calls back to back, each carrying the next chunks into the
ignored folder before the machine goes idle. (Compressed, it stays large: the bf16 weights are 16-bit
patterns with little redundancy for a byte-level compressor; see docs/pretrained.md.)

``split`` writes ``partNN`` files (the directory's files concatenated in name order) and ``manifest.json``:
each file's name, size and SHA-256, each part's size and SHA-256. ``join`` checks every part's digest, rebuilds
the files, checks theirs, and stops with a message naming the first part or file that does not match.
``join`` also accepts the parts split over several folders (``--from A --from B``), as they arrive.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import sys
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1


class ChunkError(RuntimeError):
    pass


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def split(model_dir: Path, into: Path, chunk_bytes: int, *, xz: bool = False) -> dict:
    """Split every regular file directly in ``model_dir`` into ``into/partNN`` of at most ``chunk_bytes``
    (``xz``: the files' concatenation compressed with Python's lzma, preset 6, then split)."""
    if chunk_bytes < 1:
        raise ChunkError("the chunk size must be positive")
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    if not files:
        raise ChunkError(f"{model_dir} holds no file")
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob("part*"):
        old.unlink()
    manifest = {"format": FORMAT, "chunk_bytes": chunk_bytes, "compression": "xz" if xz else "none",
                "files": [], "parts": []}
    writer = _Parts(into, chunk_bytes, manifest["parts"])
    compressor = lzma.LZMACompressor(preset=6) if xz else None
    for path in files:
        manifest["files"].append({"name": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)})
        with open(path, "rb") as src:
            while block := src.read(1 << 22):
                writer.write(compressor.compress(block) if compressor is not None else block)
    if compressor is not None:
        writer.write(compressor.flush())
    writer.close()
    (into / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


class _Parts:
    """Bytes written across ``partNN`` files of at most ``size`` bytes, each recorded with its digest."""

    def __init__(self, into: Path, size: int, record: list) -> None:
        self.into, self.size, self.record = into, size, record
        self.file, self.written, self.index = None, 0, -1

    def write(self, data: bytes) -> None:
        while data:
            if self.file is None or self.written == self.size:
                self.close()
                self.index += 1
                self.file, self.written = open(self.into / f"part{self.index:02d}", "wb"), 0
            take = data[:self.size - self.written]
            self.file.write(take)
            self.written += len(take)
            data = data[len(take):]

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            path = self.into / f"part{self.index:02d}"
            self.record.append({"name": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)})
            self.file = None


def join(sources: list[Path], to: Path) -> dict:
    """Rebuild the files of the manifest found in ``sources`` into ``to``, every digest checked."""
    manifests = [s / MANIFEST for s in sources if (s / MANIFEST).is_file()]
    if not manifests:
        raise ChunkError(f"no {MANIFEST} in {', '.join(map(str, sources))}")
    manifest = json.loads(manifests[0].read_text())
    if manifest.get("format") != FORMAT:
        raise ChunkError(f"{manifests[0]}: format {manifest.get('format')}, expected {FORMAT}")
    parts = []
    for entry in manifest["parts"]:
        found = [s / entry["name"] for s in sources if (s / entry["name"]).is_file()]
        if not found:
            raise ChunkError(f"{entry['name']} is missing (looked in {', '.join(map(str, sources))})")
        if found[0].stat().st_size != entry["bytes"] or sha256(found[0]) != entry["sha256"]:
            raise ChunkError(f"{found[0]}: size or SHA-256 differs from the manifest (a damaged or foreign part)")
        parts.append(found[0])
    to.mkdir(parents=True, exist_ok=True)
    if manifest.get("compression", "none") not in ("none", "xz"):
        raise ChunkError(f"unknown compression {manifest.get('compression')!r}")
    stream = _chain(parts, xz=manifest.get("compression") == "xz")
    for entry in manifest["files"]:
        left = entry["bytes"]
        with open(to / entry["name"], "wb") as out:
            while left:
                block = stream.read(min(left, 1 << 22))
                if not block:
                    raise ChunkError(f"the parts end inside {entry['name']}")
                out.write(block)
                left -= len(block)
        if sha256(to / entry["name"]) != entry["sha256"]:
            raise ChunkError(f"{to / entry['name']}: SHA-256 differs from the manifest after joining")
    if stream.read(1):
        raise ChunkError("the parts hold more bytes than the manifest's files")
    stream.close()
    return manifest


class _chain:
    """The parts read as one stream (decompressed with ``xz``)."""

    def __init__(self, paths: list[Path], *, xz: bool = False) -> None:
        self.paths, self.current = list(paths), None
        self.decompressor = lzma.LZMADecompressor() if xz else None
        self.pending = b""

    def _raw(self, n: int) -> bytes:
        while True:
            if self.current is None:
                if not self.paths:
                    return b""
                self.current = open(self.paths.pop(0), "rb")
            block = self.current.read(n)
            if block:
                return block
            self.current.close()
            self.current = None

    def read(self, n: int) -> bytes:
        while len(self.pending) < n:
            raw = self._raw(1 << 22)
            if self.decompressor is None:
                if not raw:
                    break
                self.pending += raw
                continue
            if self.decompressor.eof:
                if raw:
                    raise ChunkError("the parts hold bytes after the end of the compressed stream")
                break
            if not raw:
                raise ChunkError("the parts end inside the compressed stream")
            try:
                self.pending += self.decompressor.decompress(raw)
                if self.decompressor.eof and self.decompressor.unused_data:
                    raise ChunkError("the parts hold bytes after the end of the compressed stream")
            except lzma.LZMAError as exc:
                raise ChunkError(f"the compressed stream does not decompress: {exc}") from None
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def close(self) -> None:
        if self.current is not None:
            self.current.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split")
    s.add_argument("model_dir", type=Path, nargs="?", default=None,
                   help="default: the cached bf16 smollm2-135m-instruct of faircast_ds.models.pretrained")
    s.add_argument("--into", type=Path, default=Path("runs/gpu-model-chunks"))
    s.add_argument("--chunk-mb", type=float, default=30.0)
    s.add_argument("--xz", action="store_true", help="compress with Python's lzma (the other side needs only Python)")
    j = sub.add_parser("join")
    j.add_argument("--from", dest="sources", type=Path, action="append")
    j.add_argument("--to", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            model_dir = args.model_dir
            if model_dir is None:
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
                from faircast_ds.models.pretrained import checkpoint

                model_dir = checkpoint("smollm2-135m-instruct")
            m = split(model_dir, args.into, int(args.chunk_mb * 1e6), xz=args.xz)
            print(f"{len(m['files'])} files, {sum(f['bytes'] for f in m['files']):,} bytes -> {len(m['parts'])} parts, "
                  f"{sum(p['bytes'] for p in m['parts']):,} bytes ({m['compression']}) in {args.into}")
        else:
            m = join(args.sources or [Path("runs/gpu-model-chunks")], args.to)
            print(f"{len(m['parts'])} parts -> {len(m['files'])} files in {args.to}, every SHA-256 checked")
    except ChunkError as exc:
        print(f"gpu_model_chunks: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
