"""What a task of srun or mpirun reads from its scheduler's environment: the variables below are those a real
srun -n 2 (Slurm 22.05), a real mpirun -np 2 (Open MPI 4.1) and MPICH's Hydra set (captured with env in a task).
The launches themselves, on a real Slurm and Open MPI, are tests/distributed/test_cluster_launch.py."""

from __future__ import annotations

import pytest

from polytrain.distributed.cluster import Placement, adopt, expand_nodelist, placement_from, tasks_per_node
from polytrain.errors import ConfigError

# srun -n 2 on one node, task 1 (trimmed to what is read, and what is not)
SRUN_TASK_1 = {
    "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "vm",
    "SLURM_JOB_NODELIST": "vm", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
}
# the batch script itself (sbatch -n 2): a job, but no step, so not one of several tasks
SBATCH_SCRIPT = {"SLURM_JOB_ID": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                 "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "2"}
OMPI_RANK_1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1952645121",
               "PMIX_NAMESPACE": "1952645121", "PMIX_RANK": "1"}
HYDRA_RANK_3 = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "6"}


def test_an_srun_task_is_a_torchrun_worker_of_its_step():
    env = dict(SRUN_TASK_1)
    placement = adopt(env)
    assert placement is not None and placement.scheduler == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2", "1", "2")
    assert env["MASTER_ADDR"] == "127.0.0.1"  # one node: the job meets on loopback
    assert env["POLYTRAIN_CLUSTER"] == "slurm"
    other = dict(SRUN_TASK_1, SLURM_PROCID="0", SLURM_LOCALID="0")
    assert placement_from(other).master_port == placement.master_port  # every task of the step agrees
    assert placement_from(dict(SRUN_TASK_1, SLURM_JOB_ID="2")).master_port != placement.master_port
    requeued = placement_from(dict(SRUN_TASK_1, SLURM_RESTART_COUNT="1"))
    assert requeued.restart_count == 1 and requeued.master_port != placement.master_port
    assert adopt(env) is None  # adopted once; a second run in the process keeps it


def test_tasks_on_several_nodes_meet_at_the_first_node_of_the_step():
    # srun -N 3 -n 5 on gpu[07-09]: 2, 2 and 1 tasks; this is task 4, alone on the third node
    env = dict(SRUN_TASK_1, SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NODEID="2", SLURM_STEP_NUM_TASKS="5",
               SLURM_STEP_NUM_NODES="3", SLURM_STEP_NODELIST="gpu[07-09]", SLURM_JOB_NODELIST="gpu[01-09]",
               SLURM_STEP_TASKS_PER_NODE="2(x2),1")
    placement = placement_from(env)
    assert (placement.rank, placement.world_size, placement.local_rank, placement.local_world_size) == (4, 5, 0, 1)
    assert placement.master_addr == "gpu07"
    assert placement.peer == "gpu07"  # a node other than this one (vm), whose route names gloo's interface
    assert placement_from(dict(env, MASTER_ADDR="10.0.0.7", MASTER_PORT="29400")).master_addr == "10.0.0.7"
    assert placement_from(dict(env, MASTER_ADDR="10.0.0.7", MASTER_PORT="29400")).master_port == 29400


def test_what_is_not_one_of_several_tasks_is_left_to_the_local_launcher():
    assert placement_from(SBATCH_SCRIPT) is None  # the batch script: polytrain train spawns its own workers
    assert placement_from(dict(SRUN_TASK_1, SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")) is None  # srun -n 1
    torchrun = dict(SRUN_TASK_1, RANK="0", WORLD_SIZE="8", MASTER_ADDR="h")  # srun torchrun ...: torchrun's
    assert placement_from(torchrun) is None
    assert placement_from(dict(SRUN_TASK_1, POLYTRAIN_CLUSTER="none")) is None
    assert placement_from({}) is None


def test_mpi_ranks_of_open_mpi_and_of_mpich():
    placement = placement_from(OMPI_RANK_1)
    assert placement == Placement("mpi", 1, 2, 1, 2, "127.0.0.1", placement.master_port)
    assert 20000 <= placement.master_port < 40000
    # Open MPI's mpirun inside an allocation starts its daemons through srun: the ranks are MPI's, not the step's
    assert placement_from({**SRUN_TASK_1, **OMPI_RANK_1, "SLURM_STEP_NUM_TASKS": "1"}).rank == 1
    hydra = placement_from(dict(HYDRA_RANK_3, MASTER_ADDR="node0"))
    assert (hydra.rank, hydra.world_size, hydra.local_rank, hydra.local_world_size, hydra.master_addr,
            hydra.master_port) == (3, 4, 1, 2, "node0", 29500)


def test_mpirun_over_several_machines_needs_master_addr():
    with pytest.raises(ConfigError, match=r"^mpirun over several machines \(4 ranks, 2 on this one\): MPI does not "
                                          r"say where rank 0 runs; pass its host name, e\.g\. mpirun -x MASTER_ADDR"):
        placement_from(HYDRA_RANK_3)
    with pytest.raises(ConfigError, match=r"^MPI: PMI_SIZE is set but MPI_LOCALRANKID/MPI_LOCALNRANKS are not"):
        placement_from({"PMI_RANK": "1", "PMI_SIZE": "4", "MASTER_ADDR": "node0"})
    with pytest.raises(ConfigError, match=r"^SLURM_PROCID='x' is not a whole number"):
        placement_from(dict(SRUN_TASK_1, SLURM_PROCID="x"))


def test_compressed_node_lists_and_task_counts():
    assert expand_nodelist("gpu[01-03,7],login-a[1-2]-ib") == ["gpu01", "gpu02", "gpu03", "gpu7", "login-a1-ib",
                                                                "login-a2-ib"]
    assert expand_nodelist("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert expand_nodelist("vm") == ["vm"]
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="unbalanced brackets"):
        expand_nodelist("gpu[01-03")
    with pytest.raises(ConfigError, match="is not in Slurm's form"):
        tasks_per_node("2x3")


def test_what_a_scheduler_leaves_unsaid_is_one_line():
    with pytest.raises(ConfigError, match=r"^srun: SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are empty, so the first "
                                          r"node is unknown; set MASTER_ADDR to the host of task 0$"):
        placement_from(dict(SRUN_TASK_1, SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="", SLURM_JOB_NODELIST=""))
    with pytest.raises(ConfigError, match=r"^OMPI_COMM_WORLD_RANK is not set: this process was started by a "
                                          r"scheduler that did not say where it belongs"):
        placement_from({k: v for k, v in OMPI_RANK_1.items() if k != "OMPI_COMM_WORLD_RANK"})
    with pytest.raises(ConfigError, match=r"^node list 'gpu\[a-b\]': 'a-b' is not a number or a range like 01-04$"):
        expand_nodelist("gpu[a-b]")


def test_rank_0_that_cannot_host_the_rendezvous_says_what_to_set(monkeypatch):
    from datetime import timedelta

    from polytrain.distributed.torchrun import scheduler_store

    assert scheduler_store(1, timedelta(seconds=5)) is None  # only rank 0 hosts it
    monkeypatch.setenv("MASTER_PORT", "0")
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    with pytest.raises(ConfigError, match=r"^rank 0 cannot find the rendezvous host no-such-host\.invalid: .*; set "
                                          r"MASTER_ADDR to the host of rank 0$"):
        scheduler_store(0, timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: an address this machine does not have
    with pytest.raises(ConfigError, match=r"^rank 0 cannot host the rendezvous at 192\.0\.2\.1:0 \(cannot listen on "
                                          r"192\.0\.2\.1:0: .*\); set MASTER_PORT to a free port, and MASTER_ADDR to "
                                          r"the host rank 0 runs on$"):
        scheduler_store(0, timedelta(seconds=5))


def test_max_restarts_that_the_scheduler_cannot_give_is_refused_before_training(monkeypatch):
    from polytrain.train.requeue import check_scheduler_restarts

    monkeypatch.setenv("POLYTRAIN_CLUSTER", "mpi")
    check_scheduler_restarts(0)
    with pytest.raises(ConfigError, match=r"^--max-restarts 2: nothing restarts the ranks of an mpirun job; leave "
                                          r"--max-restarts out and run the same command again with --resume"):
        check_scheduler_restarts(2)
    monkeypatch.setenv("POLYTRAIN_CLUSTER", "slurm")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match=r"^--max-restarts 1 under srun needs scontrol on PATH and SLURM_JOB_ID: a "
                                          r"restart is Slurm requeueing the job$"):
        check_scheduler_restarts(1)
