#!/usr/bin/env python3
"""Does a source change leave the generated GPU code as it was? For refactors that cannot be run
on a GPU: build each module's cubin from the working tree and from another revision's sources, and
compare their code sections.

    python tools/same_code.py --base HEAD [--arch 9.0a] [OP ...]

The modules are the named ops' representative variants (as for tools/compile_check.py; every op
when none is named). A module's own sources (KernelSpec.sources) are taken from ``--base`` where
they differ from the working tree; headers always come from the working tree. Both sides build
without line information, whose tables move with every changed line. A module is "identical" when
the sections that hold code and its launch metadata (.text.*, .nv.info*, .nv.constant*,
.nv.shared*, .nv.global*) are byte-identical: symbol and string tables are not compared. Exit
status 1 when any module differs.
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from fi_core.arch import Arch
from fi_core.cli import collect_specs
from fi_core.jit.build import compile_command, require_nvcc

ROOT = Path(__file__).resolve().parents[1]
CODE_PREFIXES = (".text", ".nv.info", ".nv.constant", ".nv.shared", ".nv.global")


def elf_sections(data: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF file (a cubin)."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    out = {}
    for name_off, kind, _flags, _addr, off, size, *_ in headers:
        end = data.index(b"\0", strtab + name_off)
        name = data[strtab + name_off:end].decode()
        out[name] = b"" if kind == 8 else data[off:off + size]  # 8: SHT_NOBITS
    return out


# nvcc names an anonymous namespace after a hash of the source's path, which differs between the
# working tree and the base's copy
_ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_")


def code_sections(cubin: Path) -> dict[str, bytes]:
    return {_ANON.sub("_GLOBAL__N__", k): v for k, v in elf_sections(cubin.read_bytes()).items()
            if k.startswith(CODE_PREFIXES)}


def build_cubin(spec, src: Path, out: Path, nvcc: Path, include: Path) -> None:
    """``src`` as a cubin, with ``include`` searched first (the working tree's folder of the
    module's source, for its own quoted includes)."""
    full = compile_command(spec, src, out, nvcc)
    full[1:1] = ["-I", str(include)]
    cmd = []
    for i, c in enumerate(full):  # drop -lineinfo and the -Xptxas -v pair (ptxas's report)
        ptxas_v = (c == "-Xptxas" and full[i + 1:i + 2] == ["-v"]) or (c == "-v" and full[i - 1] == "-Xptxas")
        if c != "-lineinfo" and not ptxas_v:
            cmd.append(c)
    cmd[cmd.index("-c")] = "-cubin"
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvcc failed for {spec.name}:\n{res.stderr[-3000:]}")


def base_source(rev: str, src: Path, tmp: Path) -> Path | None:
    """``src`` as of ``rev`` in ``tmp`` (same file name), or None when it is unchanged."""
    rel = src.resolve().relative_to(ROOT)
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel.as_posix()}"], capture_output=True)
    if old.returncode:
        raise RuntimeError(f"{rel} is not in {rev}: {old.stderr.decode().strip()}")
    if old.stdout == src.read_bytes():
        return None
    dst = tmp / rev.replace("/", "_") / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(old.stdout)
    return dst


def compare(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """Differing code sections, each with how many of its 16-byte instruction slots differ."""
    found = []
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x == y:
            continue
        if x is None or y is None:
            found.append(f"{name}: only in {'the working tree' if x is None else 'the base'}")
            continue
        slots = sum(1 for i in range(0, max(len(x), len(y)), 16) if x[i:i + 16] != y[i:i + 16])
        found.append(f"{name}: {len(x)} -> {len(y)} bytes, {slots} 16-byte slots differ")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose module sources are compared")
    ap.add_argument("--arch", action="append", help="default 9.0a")
    ap.add_argument("ops", nargs="*")
    args = ap.parse_args()
    archs = [Arch.parse(a) for a in (args.arch or ["9.0a"])]
    nvcc = require_nvcc()
    specs = collect_specs(archs, args.ops)
    differ = checked = 0
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for i, spec in enumerate(specs):
            srcs = [Path(s) for s in spec.sources]
            olds = [base_source(args.base, s, tmp) for s in srcs]
            if all(o is None for o in olds):
                continue
            checked += 1
            lines = []
            for src, old in zip(srcs, olds):
                if old is None:
                    continue
                new_bin, old_bin = tmp / f"{i}_new.cubin", tmp / f"{i}_old.cubin"
                build_cubin(spec, src, new_bin, nvcc, src.parent)
                build_cubin(spec, old, old_bin, nvcc, src.parent)
                lines += [f"{src.name}: {d}" for d in compare(code_sections(old_bin), code_sections(new_bin))]
            differ += bool(lines)
            print(f"  {'DIFFERENT' if lines else 'identical'}  {spec.name} [{spec.arch}]", flush=True)
            for line in lines:
                print(f"      {line}")
    print(f"{checked} module(s) with changed sources, {differ} with different code")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
