"""sync on N gloo workers must end where single on the whole global batch ends.

Why these learning rates: sync and single add the same float32 numbers in different orders (and oneDNN
picks kernels by batch shape), so activations differ in the last bits. With max-pooling and ReLU a
near-tie can flip, and Adam turns the tiny gradient this leaves on a barely-alive unit into a full step:
at lr 1e-3 the CIFAR CNN drifts up to 1e-3 between two float32 runs that differ only in micro-batch size,
sync or not. At the rates below that floor is ~1e-7, while a real bug (wrong slice, wrong average,
missed accumulation) moves parameters by >1e-3: the test asserts both.
"""

import pytest
import torch

from polytrain.config import make_config
from polytrain.data.base import DataBundle, TensorData
from polytrain.distributed.topology import Topology
from polytrain.train.trainer import Trainer
from tests.helpers.spawn import spawn

STEPS = 10  # each case moves its parameters by 2.8e-3 (the CNN with SGD) to 3.1e-2 of their norm in 10 steps
GLOBAL_BATCH = 16
CASES = [  # (model, optimizer, accumulate)
    (model, optimizer, accumulate)
    for model in ("mlp", "cifar_cnn")
    for optimizer in ("sgd", "adam")
    for accumulate in (1, 2)
]


def _bundle() -> DataBundle:
    gen = torch.Generator().manual_seed(7)  # inputs like standardised CIFAR crops, arbitrary labels
    x = torch.randn(96, 3, 24, 24, generator=gen)
    y = torch.randint(0, 10, (96,), generator=gen)
    return DataBundle("parity", TensorData(x[:80], y[:80]), TensorData(x[80:], y[80:]), (3, 24, 24), 10)


def _config(strategy: str, model: str, optimizer: str, accumulate: int, **extra):
    lr = 0.002 if optimizer == "sgd" else 1e-4
    return make_config(strategy=strategy, model=model, optimizer=optimizer, lr=lr, momentum=0.9,
                       accumulate=accumulate, batch_size=GLOBAL_BATCH, steps=STEPS, seed=7, progress="off",
                       eval_every=0, **extra)


def _final_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    model = trainer.session.strategy.module
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_all_cases(ctx, bundle, comm):
    out = []
    for case in CASES:
        trainer = Trainer(_config("sync", *case, comm=comm), ctx.topology, data=bundle)
        trainer.fit()
        out.append(_final_params(trainer))
    return out, trainer.session.strategy.describe()


def _relative_error(a: dict, b: dict) -> float:
    diff = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    norm = torch.sqrt(sum((b[k].double() ** 2).sum() for k in b))
    return (diff / norm).item()


@pytest.fixture(scope="module")
def reference():
    bundle = _bundle()
    refs = []
    for case in CASES:
        trainer = Trainer(_config("single", *case), Topology(), data=bundle)
        trainer.fit()
        refs.append(_final_params(trainer))
    return bundle, refs


@pytest.mark.parametrize("workers, comm, through", [
    (2, "backend", "the process group's all-reduce"),  # gloo
    (2, "shm", "shared memory"),
    (4, "auto", "shared memory"),
])
def test_sync_matches_single_on_the_global_batch(reference, workers, comm, through):
    bundle, refs = reference
    results = spawn(_train_all_cases, workers, bundle, comm)
    for rank_result, described in results:  # every replica ends identical to the reference
        assert f"gradients averaged through {through}" in described
        for case, got, want in zip(CASES, rank_result, refs):
            err = _relative_error(got, want)
            assert err <= 1e-5, f"{workers} workers, case {case}: relative error {err:.2e}"

    # and every run really moved its parameters, so agreement is not trivial
    for case, ref in zip(CASES, refs):
        initial = _final_params(Trainer(_config("single", *case), Topology(), data=bundle))
        assert _relative_error(initial, ref) > 1e-3, f"case {case} barely trained"


def _without_dev_shm(ctx, bundle, comm):
    import polytrain.distributed.shm as shm

    shm.SHM_DIR = "/nonexistent-shm"  # as on a machine without /dev/shm
    trainer = Trainer(_config("sync", "mlp", "sgd", 1, comm=comm), ctx.topology, data=bundle)
    return trainer.session.strategy.describe()


def test_without_shared_memory_auto_uses_the_backend_and_says_why_and_shm_refuses(reference):
    bundle, _ = reference
    described = spawn(_without_dev_shm, 2, bundle, "auto")[0]
    assert "gradients averaged through the process group's all-reduce (/nonexistent-shm is not available)" \
        in described
    with pytest.raises(Exception, match="--comm shm cannot be used: /nonexistent-shm is not available; "
                                        "pass --comm backend or auto"):
        spawn(_without_dev_shm, 2, bundle, "shm")


def _bucket_sizes(ctx, bundle, bucket_mb):
    extra = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    trainer = Trainer(_config("sync", "cifar_cnn", "sgd", 1, **extra), ctx.topology, data=bundle)
    trainer.fit()  # DDP settles its buckets in the order gradients became ready, after the first step
    sizes = trainer.session.model._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    return [int(size) for size in sizes.split(",")]


def test_gradients_go_out_in_buckets_while_backward_runs_unless_one_bucket_size_is_chosen(reference):
    bundle, _ = reference
    classifier_bytes = 4 * (384 * 2304 + 384)  # its big fully connected layer, among the first backward reaches
    overlapped = spawn(_bucket_sizes, 2, bundle, None)[0]
    # DDP's own layout: a bucket holding the big classifier goes out while the convolutions' backward runs
    assert len(overlapped) >= 2 and overlapped[0] >= classifier_bytes, overlapped
    assert spawn(_bucket_sizes, 2, bundle, 25.0)[0] == [sum(overlapped)]  # --bucket-mb 25: all in one
