# Sourced by scripts/gpu-prepare.sh (where Rust is) and scripts/gpu-env.sh (on the GPU
# machine): the kernel cache that NVRTC filled here, carried to the GPU machine as one file.

# pack_kernel_cache DIR: DIR/kernel-cache into DIR/kernel-cache.txz, and the folder removed.
# xz with a 64 MiB window over the files in order of size: the cubins of one part compiled for
# two binaries (ours and a base build's, or a broken test binary's) differ in a few bytes and
# lie side by side, so each pair packs as one; gzip's 32 KiB window packed two caches into half
# of the 64 MiB that a device call carries, xz into a few MiB.
pack_kernel_cache() {
  (
    set -o pipefail
    cd "$1" && ls -S kernel-cache | sed 's|^|kernel-cache/|' | tar cf - -T - | xz -9 -T2 >kernel-cache.txz
  ) && rm -rf "$1/kernel-cache"
}

# unpack_kernel_cache DIR: DIR/kernel-cache.txz into DIR/kernel-cache, unless that folder is
# there already. By Python's tarfile: the GPU machine's Python reads xz, whatever tools it has.
unpack_kernel_cache() {
  if [ -f "$1/kernel-cache.txz" ] && [ ! -d "$1/kernel-cache" ]; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$1/kernel-cache.txz" "$1"
  fi
}
