#!/bin/sh
# Strategies over an emulated network (docs/network-lab.md): 2 workers, each process in a network namespace of
# its own on a 100 Mbit/s link (each way), digits_cnn on digits, SGD lr 0.05 momentum 0.9, 3 interleaved rounds.
# Needs root. Results: benchmarks/results/netlab-cpu-2core-digits_cnn-100mbit{,-compute-bound}/.
set -e
OUT=${OUT:-benchmarks/results}
# 8 examples per worker per step: the link is the bottleneck of sync (about 0.05 s of link time per step for
# digits_cnn's 151,306 parameters, more than a step's compute)
polytrain compare --strategies sync,diloco:sync_every=8,async --straggler 1:2 --link 100mbit \
    --worker-batch-size 8 --repeats 3 --out "$OUT/netlab-cpu-2core-digits_cnn-100mbit"
# 256 examples per worker per step: compute is the bottleneck; where async's work stealing can pay off
polytrain compare --strategies sync,async --straggler 1:2 --link 100mbit \
    --worker-batch-size 256 --steps 40 --eval-every 20 --log-every 10 --repeats 3 \
    --out "$OUT/netlab-cpu-2core-digits_cnn-100mbit-compute-bound"
# the same with 512 examples per worker, 30 steps, --eval-every 10 --log-every 10:
#   benchmarks/results/netlab-cpu-2core-digits_cnn-100mbit-compute-bound-512/
