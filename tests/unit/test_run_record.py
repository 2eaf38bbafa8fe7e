"""rloo_workflow/run_record.py: what the last `snakemake` run was given."""

from __future__ import annotations


def test_the_last_runs_arguments_come_back_with_its_config_values_as_a_file(tmp_path):
    """For `rloo why-rerun` and `rloo dvc` without --configfile: the files, the --config values (as a file) and
    the targets."""
    import yaml

    from rloo_workflow.run_record import LAST_RUN_CONFIG, record, run_args

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "a.yaml").write_text("seed: 1\n")
    assert run_args(tmp_path, []).configfiles == [] and run_args(tmp_path, []).source is None  # no run yet
    record(tmp_path, [tmp_path / "config" / "a.yaml"], {"rloo": {"lr": 0.001}}, ["results/x.json"])
    got = run_args(tmp_path, [])
    assert got.configfiles == ["config/a.yaml", LAST_RUN_CONFIG] and got.targets == ["results/x.json"]
    assert yaml.safe_load((tmp_path / LAST_RUN_CONFIG).read_text()) == {"rloo": {"lr": 0.001}}
    assert 'results/x.json --configfile config/a.yaml --config rloo={"lr": 0.001}' in got.source
    assert run_args(tmp_path, ["other.yaml"]).configfiles == ["other.yaml"]  # given: as given
