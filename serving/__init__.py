"""The serving processes: the engine core process's loop (`core_process.py`) and the HTTP front
(`http_front/`); the executor process is `executors/process/`."""
