"""What is built on the engine: the command line, the benchmark, the planning simulation,
the synthetic checkpoints, inspect/verify and convert. The engine never imports these.
"""
