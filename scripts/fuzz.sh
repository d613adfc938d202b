#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer, AddressSanitizer) of the parsers that read
# untrusted bytes: the OpenAI JSON bodies, the gRPC request messages, image and video files.
#
#   scripts/fuzz.sh TARGET SECONDS [JOBS]     one target (openai_chat, grpc_request,
#                                             image_decode, video_decode)
#   scripts/fuzz.sh all SECONDS               each target in turn
#
# Needs a nightly toolchain (`rustup toolchain install nightly`) and `cargo install
# cargo-fuzz`; not part of CI, which runs the bounded property tests (fuzz_openai,
# fuzz_decode, fuzz_images, video_codecs' mutations) instead. The corpus grows in
# fuzz/corpus/TARGET (ignored by git), seeded from fuzz/seeds/TARGET and, for the media
# targets, from the test files and clips the ffmpeg CLI makes here. A crash is written to
# fuzz/artifacts/TARGET; replay it with `cargo +nightly fuzz run TARGET FILE`.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

target=${1:?target or all}
seconds=${2:?seconds}
jobs=${3:-1}

seed() {
  local t=$1 dir=corpus/$1
  mkdir -p "$dir"
  [ -d "seeds/$t" ] && cp -n seeds/"$t"/* "$dir"/ 2>/dev/null || true
  case $t in
    image_decode)
      cp -n ../preprocess/tests/data/*.avif "$dir"/ 2>/dev/null || true
      for ext in png jpg bmp tiff webp gif; do
        [ -e "$dir/seed.$ext" ] || ffmpeg -nostdin -loglevel error -f lavfi \
          -i testsrc2=size=24x16:duration=0.1 -frames:v 1 "$dir/seed.$ext"
      done ;;
    video_decode)
      local src=testsrc2=size=32x24:rate=4:duration=1
      mk() { [ -e "$dir/$1" ] || ffmpeg -nostdin -loglevel error -f lavfi -i $src "${@:2}" "$dir/$1"; }
      mk h264.mp4 -c:v libx264 -pix_fmt yuv420p -bf 2
      mk h264-frag.mp4 -c:v libx264 -pix_fmt yuv420p -movflags frag_keyframe+empty_moov
      mk hevc.mov -c:v libx265 -x265-params log-level=none -pix_fmt yuv420p -tag:v hvc1
      mk vp8.webm -c:v libvpx -deadline realtime
      mk vp9.mkv -c:v libvpx-vp9 -deadline realtime
      mk av1.mp4 -c:v libaom-av1 -cpu-used 8 -usage realtime
      mk mpeg4.avi -c:v mpeg4 ;;
  esac
}

run() {
  local t=$1
  seed "$t"
  echo "== $t: ${seconds}s, $jobs job(s), corpus $(ls corpus/"$t" | wc -l) files"
  local parallel=()
  # Jobs past one log to fuzz/fuzz-N.log (libFuzzer's way); one job logs here.
  [ "$jobs" -gt 1 ] && parallel=(-jobs="$jobs" -workers="$jobs")
  cargo +nightly fuzz run -O "$t" corpus/"$t" -- \
    -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -max_len=1048576 \
    "${parallel[@]}" -print_final_stats=1
}

if [ "$target" = all ]; then
  for t in openai_chat grpc_request image_decode video_decode; do run "$t"; done
else
  run "$target"
fi
