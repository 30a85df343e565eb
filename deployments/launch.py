"""``make serve``: ``serve run`` on a local Ray sized for one machine.

``python -m deployments.launch serve_config.yaml [--dashboard] [serve run's options]``

``serve run`` with no cluster to join starts a local Ray with Ray's defaults, made for clusters of many cores. On a
machine of a few cores they take CPU from the engine's threads, and a step of the engine stalls for as long as any
other process holds one of its cores: Ray's dashboard (its web frontend and a process per module) and Serve's
controller, which runs its loop ten times a second and asks GCS for every node's resources each time, spent more
CPU during a 32-stream load than the ingress replica that streams every token (docs/performance.md).

This starts that local Ray itself: without the dashboard unless ``--dashboard`` is given (Ray then keeps one process
for its usage statistics alone; ``serve status`` and ``serve deploy``, which ask the dashboard, need the flag), with
the controller's loop at 0.5 s and Serve's direct ingress on (``SERVE_ENV``; a variable already set keeps its value),
then hands over to ``serve run``, which finds Ray started and runs the config on it; Ctrl-C stops both, as with
``serve run``. Given a cluster (``--address`` or ``RAY_ADDRESS``) or a ``runtime_env`` for ``ray.init``
(``--runtime-env``, ``--runtime-env-json``, ``--working-dir``), it starts nothing: the command is ``serve run``, with
``SERVE_ENV`` in this process's environment (a cluster's processes take theirs from its ``ray start``). A local node
that times out during startup is started again (:func:`init_local_ray`).
"""

from __future__ import annotations

import os
import signal
import sys

# The controller, the proxy and the replicas read these when they start; a local Ray gives its processes the
# environment of the process that started it.
SERVE_ENV = {
    # the ingress replica also serves HTTP on its own port (30000 up): a streamed token skips the proxy's hop
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    # Serve's default is 0.1 s. Its loop notices new, failed and finished replicas and takes autoscaling decisions;
    # health checks keep their own period (10 s), and requests never wait on the loop.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}
DASHBOARD_FLAG = "--dashboard"
# On a busy machine a local Ray's node can fail to start: its raylet gives its dashboard agent ~15 s to report its ports
# and aborts past that (Ray 2.60, not configurable), and ray.init raises at the end of its own 30 s wait, saying this.
NODE_START_TIMED_OUT = "timed out during startup"
RAY_START_ATTEMPTS = 3
# serve run's options that decide how it calls ray.init itself
_OWN_RAY_INIT = ("--address", "-a", "--runtime-env", "--runtime-env-json", "--working-dir")


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C (SIGINT) stops serve run and the Ray it started, also where this was started with SIGINT ignored (a
    # background job of a non-interactive shell, a test run): an ignored signal would stay ignored through exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = list(sys.argv[1:] if argv is None else argv)
    dashboard = DASHBOARD_FLAG in args
    args = [arg for arg in args if arg != DASHBOARD_FLAG]
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)
    if starts_local_ray(args, os.environ):
        import ray

        from deployments.ray_compat import serve_namespace

        # "local": a Ray of its own even where `ray start` runs a cluster on this machine (ray.init() would join it,
        # and serve run's Ctrl-C would then shut down Serve there, every application of it)
        init_local_ray(address="local", namespace=serve_namespace(), include_dashboard=dashboard)
    from ray.serve.scripts import cli

    cli.main(["run", *args], prog_name="serve")


def init_local_ray(**options) -> None:
    """``ray.init(**options)`` starting a local Ray, again (up to ``RAY_START_ATTEMPTS`` times) where its node timed out
    during startup; any other failure raises at once. What a failed start left running (its GCS) is Ray's to stop:
    each start registers its processes to be killed when this process exits, and they share its fate."""
    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(**options)
            return
        except Exception as error:  # Ray raises a bare Exception for it
            if NODE_START_TIMED_OUT not in str(error) or attempt == RAY_START_ATTEMPTS:
                raise
            print(f"Ray's node did not start ({error}): starting it again", file=sys.stderr, flush=True)
            ray.shutdown()


def starts_local_ray(args: list[str], environ) -> bool:
    """Whether this launcher starts the local Ray, rather than leave ray.init to serve run."""
    if environ.get("RAY_ADDRESS"):
        return False
    return not any(arg == option or arg.startswith(option + "=") for arg in args for option in _OWN_RAY_INIT)


if __name__ == "__main__":
    main()
