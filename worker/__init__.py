"""cy-llm worker: StreamPredict over a Unix socket, admitted by a TaskScheduler, run by an engine."""

__version__ = "0.1.0"
