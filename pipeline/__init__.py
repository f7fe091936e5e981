"""Ray stages around the SpecEE engine. Thin: they call the engine's public API.

pipeline.processor (ProcessorConfig, build_processor: the engine as a Ray Data Dataset -> Dataset
processor), pipeline.batch (the job), .prompts (reader), .stage (actor), .output (files), .output_lock
and .manifest (who writes the output folder, and with what): batch
generation with Ray Data; pipeline.serve: the Ray Serve app. Nothing is imported until asked for,
so importing one does not pull in the other's dependencies.
"""


def __getattr__(name: str):
    if name in ("ProcessorConfig", "build_processor", "Processor"):
        from pipeline import processor

        return getattr(processor, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
