#!/usr/bin/env python3
import json, collections
MB = 1e6
rs = [json.loads(l) for l in open('/tmp/indep/results.jsonl')]
find = {(r['model'], r['layers'], r['target'], r['pin_layout'], r['variant']): r for r in rs}
cfgs = list(dict.fromkeys((r['model'], r['layers']) for r in rs))
targets = ['gpu-a100', 'gpu-h100', 'tpu-v5e']
for model, n in cfgs:
  print(f'\n## {model}, {n} layers')
  print('| target | pin | F MB | stock T MB | fixed T MB | unit MB | stock units | fixed units | fixed<=stock |')
  print('|---|---|---|---|---|---|---|---|---|')
  for t in targets:
    for pin in (True, False):
      try:
        f, st, fx = (find[(model, n, t, pin, v)] for v in ('F', 'stock T', 'fixed T'))
      except KeyError:
        continue
      u = fx['largest_gather_bytes']
      F, S, X = f['total_bytes'], st['total_bytes'], fx['total_bytes']
      print(f"| {t} | {'pinned' if pin else 'unpinned'} | {F/MB:.1f} | {S/MB:.1f} | {X/MB:.1f} | {u/MB:.1f} | {(S-F)/u:.2f} | {(X-F)/u:.2f} | {'yes' if X <= S else 'NO'} |")
mlp = sorted(n for m, n in cfgs if m == 'mlp')
if len(mlp) > 1:
  print('\n## mlp growth per layer (variant growth / F growth)')
  print('| target | pin | span | F MB/layer | stock T x | fixed T x |')
  print('|---|---|---|---|---|---|')
  for t in targets:
    for pin in (True, False):
      for lo, hi in [(mlp[0], mlp[1])] + ([(mlp[1], mlp[2]), (mlp[0], mlp[2])] if len(mlp) > 2 else []):
        try:
          g = {v: (find[('mlp', hi, t, pin, v)]['total_bytes'] - find[('mlp', lo, t, pin, v)]['total_bytes']) / (hi - lo) for v in ('F', 'stock T', 'fixed T')}
        except KeyError:
          continue
        print(f"| {t} | {'pinned' if pin else 'unpinned'} | {lo}->{hi} | {g['F']/MB:.1f} | {g['stock T']/g['F']:.2f} | {g['fixed T']/g['F']:.2f} |")
