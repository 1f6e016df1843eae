#!/usr/bin/env python3
"""Compares the device code of two builds kernel by kernel, without cuobjdump: reads the
cubins embedded in each object file (the .nv_fatbin section of build/obj/src/cuda/**/*.o) and
compares every kernel's .text section byte for byte, plus its static shared memory. Use it
when code moves or is refactored and must stay the same machine code:

    python3 scripts/kernel_diff.py OLD_BUILD/obj/src/cuda NEW_BUILD/obj/src/cuda

Prints one summary line ("kernels: N identical, M differ, ...") and the kernels that differ
or exist in one build only; exit status 1 when any kernel's code differs. Compressed fatbins
(nvcc -Xfatbin -compress-all) are not read: build both sides without compression.
"""
import glob
import hashlib
import struct
import sys


def embedded_elfs(data):
    at = data.find(b"\x7fELF", 1)  # offset 0 is the host object itself
    while at > 0:
        yield at
        at = data.find(b"\x7fELF", at + 1)


def sections(data, off):
    e = data[off:]
    if len(e) < 64 or e[4] != 2:  # 64-bit ELF only
        return {}
    shoff, = struct.unpack_from("<Q", e, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", e, 0x3A)
    if shoff + shnum * shentsize > len(e) or shstrndx >= shnum:
        return {}
    heads = [struct.unpack_from("<IIQQQQ", e, shoff + k * shentsize) for k in range(shnum)]
    names_at = heads[shstrndx][4]
    out = {}
    for name, kind, _flags, _addr, at, size in heads:
        end = e.index(b"\0", names_at + name)
        out[e[names_at + name:end].decode(errors="replace")] = ("NOBITS %d" % size).encode() if kind == 8 else e[at:at + size]
    return out


def kernels(root):
    found = {}
    for path in sorted(glob.glob(root + "/**/*.o", recursive=True)):
        data = open(path, "rb").read()
        for off in embedded_elfs(data):
            for name, body in sections(data, off).items():
                if name.startswith(".text.") or name.startswith(".nv.shared."):
                    found[name] = hashlib.sha1(body).hexdigest()
    return found


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = kernels(sys.argv[1]), kernels(sys.argv[2])
    text = lambda d: {k for k in d if k.startswith(".text.")}
    both = text(old) & text(new)
    differ = sorted(k for k in both if old[k] != new[k])
    shared = sorted(k for k in set(old) & set(new) if k.startswith(".nv.shared.") and old[k] != new[k])
    print("kernels: %d identical, %d differ, %d only in the first build, %d only in the second; static shared memory differs in %d"
          % (len(both) - len(differ), len(differ), len(text(old) - text(new)), len(text(new) - text(old)), len(shared)))
    for k in differ:
        print("differs:", k[6:])
    for k in sorted(text(old) - text(new)):
        print("only first:", k[6:])
    for k in sorted(text(new) - text(old)):
        print("only second:", k[6:])
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
