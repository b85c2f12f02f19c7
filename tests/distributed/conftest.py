import pytest

from tests.helpers.cluster_runs import launcher_env, local_reference


@pytest.fixture(scope="session")
def launcher_cli_env():
    from tests.conftest import command_env

    return launcher_env(command_env())


@pytest.fixture(scope="session")
def cluster_reference(launcher_cli_env, tmp_path_factory):
    """The model polytrain's own launcher trains with tests.helpers.cluster_runs.RUN (2 spawned workers)."""
    return local_reference(launcher_cli_env, tmp_path_factory.mktemp("local-reference"))
