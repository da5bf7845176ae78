"""scripts/kernel-cache.sh, which packs the kernel cache for the GPU machine
(scripts/gpu-prepare.sh) and unpacks it there (scripts/gpu-env.sh): every file comes back
byte for byte, and the cubins of one part compiled for two binaries, which differ in a few
bytes, pack as one."""

import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "kernel-cache.sh"


def sourced(command, cwd):
    done = subprocess.run(["bash", "-c", f'. "{SCRIPT}" && {command}'], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_packed_cache_unpacks_whole_and_twin_cubins_pack_as_one(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    cache = here / "kernel-cache"
    cache.mkdir(parents=True)
    part = os.urandom(1 << 20)
    files = {
        "gemm-a.cubin": part,
        # the same part for another binary: a few bytes of its header differ
        "gemm-b.cubin": part[:8] + bytes(32) + part[40:],
        "ce-c.cubin": os.urandom(4096),
    }
    for name, data in files.items():
        (cache / name).write_bytes(data)
    sourced("pack_kernel_cache .", here)
    assert not cache.exists()
    packed = (here / "kernel-cache.txz").stat().st_size
    assert packed < 1.2 * len(part), packed
    there.mkdir()
    (there / "kernel-cache.txz").write_bytes((here / "kernel-cache.txz").read_bytes())
    sourced("unpack_kernel_cache .", there)
    got = {p.name: p.read_bytes() for p in (there / "kernel-cache").iterdir()}
    assert got == files
    # a cache already unpacked is left as it is
    (there / "kernel-cache" / "gemm-a.cubin").write_bytes(b"kept")
    sourced("unpack_kernel_cache .", there)
    assert (there / "kernel-cache" / "gemm-a.cubin").read_bytes() == b"kept"
