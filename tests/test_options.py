"""The engine's options: one definition (specee_core.options.EngineOptions) whose defaults every surface takes and
whose checks every surface runs, once, where its settings are made."""
import dataclasses

import pytest

from specee_core import EngineOptions
from specee_core.options import OPTION_NAMES, default
from tests.conftest import BUNDLED


def test_every_surface_builds_its_engine_with_the_engine_defaults():
    from jobs.generate import build_config, parse_args
    from pipeline.processor_config import ProcessorConfig
    from pipeline.serve_args import ServeArgs
    from pipeline.stage import StageConfig

    base = EngineOptions()
    job = build_config(parse_args(["--output", "out/x", "--model", str(BUNDLED)])).stage
    assert job.engine() == base == StageConfig(model=str(BUNDLED)).engine()
    processor = ProcessorConfig(model_source=str(BUNDLED)).stage()
    assert processor.engine() == dataclasses.replace(base, engines_per_node=1)
    serve = ServeArgs(model=str(BUNDLED))
    # Serve's lanes open with room for a full batch (requests join while others decode); the rest is the default
    assert serve.engine(engines_per_node=1) == dataclasses.replace(base, min_lane_rows=base.max_batch_size)
    assert (serve.max_batch_size, serve.prefill_chunk) == (default("max_batch_size"), default("prefill_chunk"))


def test_the_batch_jobs_engine_flags_reach_the_engine():
    from jobs.generate import build_config, parse_args

    stage = build_config(parse_args(["--output", "out/x", "--batch-size", "4", "--prefill-chunk", "64",
                                     "--context-len", "1024", "--kv-block-size", "8", "--kv-cache-gb", "0.5",
                                     "--no-prefix-cache"])).stage
    assert stage.engine() == EngineOptions(max_batch_size=4, prefill_chunk=64, context_len=1024, kv_block_size=8,
                                           kv_cache_gb=0.5, prefix_cache=False)


BAD = [({"max_batch_size": 0}, "max_batch_size"), ({"prefill_chunk": 1.5}, "prefill_chunk"),
       ({"kv_cache_gb": -1}, "kv_cache_gb"), ({"context_len": 1}, "context_len"), ({"prefix_cache": "yes"}, "prefix_cache"),
       ({"kv_block_size": True}, "kv_block_size")]


@pytest.mark.parametrize("bad, field", BAD)
def test_a_bad_option_is_refused_where_it_is_set_naming_it(bad, field):
    from pipeline.processor_config import ProcessorConfig
    from pipeline.serve_args import ServeArgs

    with pytest.raises(ValueError, match=field):
        EngineOptions(**bad)
    if field not in ("max_batch_size",):  # Serve's own argument, refused in engine_options (below)
        with pytest.raises(ValueError, match=field):
            ServeArgs(model=str(BUNDLED), engine_options=bad)
    if field in ("context_len", "prefill_chunk", "kv_block_size", "kv_cache_gb", "prefix_cache"):
        with pytest.raises(ValueError, match=field):
            ProcessorConfig(model_source=str(BUNDLED), engine_kwargs=bad)


def test_serve_refuses_engine_options_it_sets_itself_or_does_not_know():
    from pipeline.serve_args import ServeArgs

    with pytest.raises(ValueError, match="arguments of their own"):
        ServeArgs(model=str(BUNDLED), engine_options={"max_batch_size": 4})
    with pytest.raises(ValueError, match="'fast_mode'.*not an engine option"):
        ServeArgs(model=str(BUNDLED), engine_options={"fast_mode": True})
    with pytest.raises(ValueError, match="skip"):  # early-exit options are checked too
        ServeArgs(model=str(BUNDLED), engine_options={"skip": "never"})
    ok = ServeArgs(model=str(BUNDLED), engine_options={"kv_block_size": 8, "threshold": 0.5})
    assert ok.engine(engines_per_node=3).kv_block_size == 8 and ok.early_exit_options() == {"threshold": 0.5}
    assert ok.engine(engines_per_node=3).engines_per_node == 3  # the replicas sharing the node's memory
    given = ServeArgs(model=str(BUNDLED), engine_options={"kv_cache_gb": 1.0})
    assert given.engine(engines_per_node=3).engines_per_node == 1  # a budget given is the replica's own


def test_options_are_fixed_once_made():
    opts = EngineOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.max_batch_size = 64
    assert set(OPTION_NAMES) == {f.name for f in dataclasses.fields(EngineOptions)}
