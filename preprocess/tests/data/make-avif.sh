#!/usr/bin/env bash
# Writes the AVIF test files from avif_source.png with libavif's own tools (Debian's
# libavif-bin 0.11.1: `apt-get install libavif-bin`), and libavif's decodes of the lossy ones,
# the reference `avif_stills_decode_as_libavif_does` compares against. Not on CI's path: the
# outputs are committed.
set -euo pipefail
cd "$(dirname "$0")"
avifenc -l avif_source.png lossless.avif
avifenc -y 444 --min 20 --max 20 avif_source.png lossy444.avif
avifenc -y 420 --min 20 --max 20 avif_source.png lossy420.avif
avifdec lossy444.avif lossy444.avifdec.png
avifdec lossy420.avif lossy420.avifdec.png
