"""Locust's statistics as they stand when a run ends.

Locust rewrites its ``--csv`` files once a second from a background greenlet
and not again at shutdown, so a run that ends soon after its last request
leaves CSV files that miss the requests of its last second. A locustfile that
imports this module gets a ``--stats-json PATH`` option: when locust quits,
one row per statistics entry is written there, complete. Read it back with
``loadtest.run_locust.read_final_stats`` (which does not import locust: locust
patches the standard library on import).
"""
import json
import pathlib

from locust import events


@events.init_command_line_parser.add_listener
def _add_option(parser):
    parser.add_argument("--stats-json", default="",
                        help="write every statistics entry here as JSON when the run ends")


@events.quitting.add_listener
def _save(environment, **_):
    path = getattr(environment.parsed_options, "stats_json", "")
    if not path or environment.runner is None:
        return
    stats = environment.runner.stats
    window = (stats.last_request_timestamp or 0) - (stats.start_time or 0)
    rows = [{"type": e.method, "name": e.name, "count": e.num_requests, "failures": e.num_failures,
             "p50_ms": float(e.get_response_time_percentile(0.5)),
             "p90_ms": float(e.get_response_time_percentile(0.9)),
             "p99_ms": float(e.get_response_time_percentile(0.99)),
             "mean_ms": e.avg_response_time, "content_length": e.total_content_length,
             "rate": e.num_requests / window if window > 0 else 0.0}  # requests/s, as locust's tables count it
            for e in stats.entries.values()]
    pathlib.Path(path).write_text(json.dumps(rows, indent=1))
