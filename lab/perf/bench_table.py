"""Print the short throughput table from a `trellis bench --json` log (last JSON document in the file)."""

import json
import sys

text = open(sys.argv[1]).read()
doc = json.loads(text[text.index("{"):])
env = doc["environment"]
print(f"{env['gpu']} smi={env.get('nvidia_smi')} kernel={env['kernel']['build_hash']} copy={doc['copy_gbps']:.0f}GB/s")
print(f"{'M':>5} {'fused':>8} {'min':>8} {'max':>8} {'2pass':>8} {'f/2p':>5} {'exp':>4} {'MB':>7} {'GB/s':>6} "
      f"{'%cp':>5} {'TF/s':>6} {'Gw/ms':>6} plan")
for r in doc["rows"]:
    f, t = r["fused"], r["two_pass"]
    print(f"{r['m']:>5} {f['median_us']:>8.1f} {f['min_us']:>8.1f} {f['max_us']:>8.1f} {t['median_us']:>8.1f} "
          f"{r['fused_over_two_pass']:>5.2f} {r['experts']:>4} {r['bytes'] / 1e6:>7.1f} {r['gbps']:>6.0f} "
          f"{r['pct_copy_bw']:>5.1f} {r['tflops']:>6.1f} {r['g_weights_per_ms']:>6.2f} {r['plan']}")
