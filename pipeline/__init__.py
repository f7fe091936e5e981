"""Ray stages around the SpecEE engine. Thin: they call the engine's public API.

pipeline.batch (driver), .prompts (reader), .stage (actor), .output (files): batch generation
with Ray Data; pipeline.serve: the Ray Serve app. Nothing is imported here, so importing one
does not pull in the other's dependencies.
"""
