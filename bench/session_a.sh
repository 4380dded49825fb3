#!/usr/bin/env bash
# call 1: geometry3k rows, mmrl graphs (fresh cache, graph-break log) then TRL at micro-batch 8, same call
set -uo pipefail
out=${OUT:-/tmp}
export OUT=$out
START=$(date +%s)
TORCH_LOGS="graph_breaks,recompiles" ROWS=geometry3k SHAPE=vl3b MODES="graphs trl" TRL_MICRO_BATCH=8 TRL_STEPS=4 RUN_TIMEOUT=270 bash bench/decode_ab.sh
echo "elapsed $(( $(date +%s) - START )) s"
grep -h "compiled graph\|recorded graph" $out/logs_vl3b_geometry3k/*.log | head -20
grep -hc "Graph break\|graph_break\|Recompiling" $out/logs_vl3b_geometry3k/*.log
tar czf $out/logs.tgz -C $out logs_vl3b_geometry3k decode_graphs_vl3b_geometry3k.log decode_trl_vl3b_geometry3k.log 2>/dev/null
rm -rf $out/logs_vl3b_geometry3k
