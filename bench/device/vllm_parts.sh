#!/usr/bin/env bash
# Re-cut the vLLM wheel set (../shared/vllm-offline/vllm_wheels.sh DIR: part1 = the wheel's first
# 57.7 MB, part2 = its rest and two small wheels, part3 = the installer and more wheels) so that each
# call's transfer fits in 64 MiB beside this repository's tree (9 MB on 2026-12-02; part1 no longer
# fitted). Makes DIR/p1 (the wheel's first $P1_BYTES, 48,000,000 bytes: 50,000,000 no longer fitted beside an 18 MB tree, 2026-12-03), DIR/p2 (part2's piece), DIR/p3 (the rest
# of part1's piece and part2's small wheels: p2 with that rest no longer fitted beside a 13.6 MB tree,
# 2026-12-03). On the GPU machine, three calls back to back:
#   carry DIR/p1:                      bash bench/device/run.sh vllm-p1
#   carry DIR/p2:                      bash bench/device/run.sh vllm-p2
#   carry DIR/p3, DIR/part3, .whl:     bash bench/device/run.sh setup vllm
#   bash bench/device/vllm_parts.sh [.vllm]
set -euo pipefail
D=${1:-.vllm}
p0=$(ls "$D"/part1/*.part-00) p1=$(ls "$D"/part2/*.part-01)
w=$(basename "$p0" .part-00)
mkdir -p "$D/p1" "$D/p2" "$D/p3"
head -c "${P1_BYTES:-48000000}" "$p0" > "$D/p1/$w.part-00a"
tail -c +$(( ${P1_BYTES:-48000000} + 1 )) "$p0" > "$D/p3/$w.part-00b"
cp "$p1" "$D/p2/"
cp "$D"/part2/*.whl "$D/p3/"
cat "$D/p1/$w.part-00a" "$D/p3/$w.part-00b" | cmp -s - "$p0" || { echo "re-cut differs from $p0" >&2; exit 1; }
du -sb "$D/p1" "$D/p2" "$D/p3"
