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
# DIR/q1..q4 (2026-12-04: a 22 MB tree no longer fitted beside p2's 46.4 MB): the wheel's two pieces each cut in two
# at $Q_BYTES (32,000,000), part2's small wheels with q2, part3 (installer, wheels, model maker) in q4/part3; each
# call carries 32 MB at most, so a tree up to ~35 MB still fits. Five calls back to back:
#   carry .whl:                   bash bench/device/run.sh setup
#   carry DIR/q1, then q2, q3:    bash bench/device/run.sh vllm-q1   (vllm-q2, vllm-q3)
#   carry DIR/q4:                 bash bench/device/run.sh setup vllm-install ...   (or setup vllm)
# On the GPU machine the last call joins them (run.sh vllm-install):
#   bash bench/device/vllm_parts.sh --join DIR VP    VP/q holds q1-q3's files (their calls copied them there), DIR/q4
#                                                    is carried: VP/part1 and VP/part2 as install.sh takes them,
#                                                    and DIR/part3 (where install.sh and vllm_e2e.py look)
set -euo pipefail
if [ "${1:-}" = "--join" ]; then
  D=$2 V=$3
  mkdir -p "$V/part1" "$V/part2" "$D/part3"
  cp "$D"/q4/*.part-01b "$V/q/" && cp -r "$D/q4/part3/." "$D/part3/"
  n=0
  for a in "$V"/q/*.part-00a; do
    [ -f "$a" ] || { echo "no q1 piece in $V/q (vllm-q1 first)" >&2; exit 1; }
    w=$(basename "$a" .part-00a)
    cat "$a" "$V/q/$w.part-00b" > "$V/part1/$w.part-00"
    cat "$V/q/$w.part-01a" "$V/q/$w.part-01b" > "$V/part2/$w.part-01"
    n=$((n + 1))
  done
  cp "$V"/q/*.whl "$V/part2/"
  echo "joined $n wheel(s) into $V/part1, $V/part2"
  exit 0
fi
D=${1:-.vllm}
p0=$(ls "$D"/part1/*.part-00) p1=$(ls "$D"/part2/*.part-01)
w=$(basename "$p0" .part-00)
mkdir -p "$D/p1" "$D/p2" "$D/p3"
head -c "${P1_BYTES:-48000000}" "$p0" > "$D/p1/$w.part-00a"
tail -c +$(( ${P1_BYTES:-48000000} + 1 )) "$p0" > "$D/p3/$w.part-00b"
cp "$p1" "$D/p2/"
cp "$D"/part2/*.whl "$D/p3/"
cat "$D/p1/$w.part-00a" "$D/p3/$w.part-00b" | cmp -s - "$p0" || { echo "re-cut differs from $p0" >&2; exit 1; }
Q=${Q_BYTES:-32000000}
mkdir -p "$D/q1" "$D/q2" "$D/q3" "$D/q4/part3"
head -c "$Q" "$p0" > "$D/q1/$w.part-00a"
tail -c +$(( Q + 1 )) "$p0" > "$D/q2/$w.part-00b"
cp "$D"/part2/*.whl "$D/q2/"
head -c "$Q" "$p1" > "$D/q3/$w.part-01a"
tail -c +$(( Q + 1 )) "$p1" > "$D/q4/$w.part-01b"
cp -r "$D"/part3/. "$D/q4/part3/"
cat "$D/q1/$w.part-00a" "$D/q2/$w.part-00b" | cmp -s - "$p0" || { echo "q re-cut differs from $p0" >&2; exit 1; }
cat "$D/q3/$w.part-01a" "$D/q4/$w.part-01b" | cmp -s - "$p1" || { echo "q re-cut differs from $p1" >&2; exit 1; }
du -sb "$D/p1" "$D/p2" "$D/p3" "$D/q1" "$D/q2" "$D/q3" "$D/q4"
