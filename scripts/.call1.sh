#!/usr/bin/env bash
nvidia-smi --query-gpu=name --format=csv,noheader
O=${OUT:-/tmp/o}
mkdir -p $O/exec $O/eth $O/old $O/coll
# Old per-plan kernel (main 25e5c59) on the same machine, before the new bundle.
( cd gpu-bundle-exec-old && tar xJf bin.tar.xz )
P=gpu-bundle-exec-old/bin/plans
for split in 4x256 2x256; do
  MSCCLPP_EXECUTOR_KERNEL=per-plan timeout 45 gpu-bundle-exec-old/bin/mscclpp-perf allreduce --plan $P/onehop_allreduce_2_ll_${split}_oop.json --ranks 2 -b 1K -e 1M -d bf16 --graph --timeout 20 > $O/old/onehop-$split.log 2>&1
  echo "old per-plan $split rc=$?"; grep -E "^ *[0-9]+ " $O/old/onehop-$split.log
done
echo "== exec at $SECONDS s"
OUT=$O/exec RUN_BUDGET=170 bash gpu-bundle-exec/run.sh > $O/exec-run.txt 2>&1
grep -v "^ *[0-9]" $O/exec-run.txt | tail -40
echo "== eth at $SECONDS s"
OUT=$O/eth RUN_BUDGET=130 bash gpu-bundle-eth/run.sh > $O/eth-run.txt 2>&1
tail -50 $O/eth-run.txt
echo "== coll at $SECONDS s"
left=$((400 - SECONDS)); [ $left -gt 30 ] && OUT=$O/coll ONLY='perf allreduce 2 processes' RUN_BUDGET=$left bash gpu-bundle-coll/run.sh > $O/coll-run.txt 2>&1
cat $O/coll/summary.txt 2>/dev/null; grep -E "^ *[0-9]+ |^#" $O/coll/perf.txt 2>/dev/null | head -60
echo "== done at $SECONDS s"
