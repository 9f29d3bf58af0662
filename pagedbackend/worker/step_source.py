"""Where a runner's model step comes from, chosen once at start: a built
step package (``step_package``) loaded, one built now and loaded, one built
in the background beside eager steps, ``torch.compile`` in this process
(``compiled``), or the eager model. Every path ends warmed up: its graphs
are built before the first request.

The step a runner calls is ``runner.compiled`` (None: eager); a background
compile hands over by setting that one attribute, so the next step uses it.
"""
import logging
import sys
import threading
import time

from pagedbackend.worker import step_package
from pagedbackend.worker.compiled import CompiledStep, compile_failure, compile_unavailable

__all__ = ["COMPILE_SWITCH_INTERVAL_S", "compile_in_background", "prepare_step"]

logger = logging.getLogger("pagedbackend")
# Python's thread switch interval while the step compiles beside eager steps.
COMPILE_SWITCH_INTERVAL_S = 5e-5


def prepare_step(runner, background: bool = False) -> None:
    """Compile the step when the config asks and this machine can (otherwise
    say once why it runs eager), then warm it up: a CPU step from its package, built now
    when missing. ``background``: warm up eager steps now and compile in a thread of its own."""
    config = runner.config
    if config.compile and not config.enforce_eager:
        reason = compile_unavailable(runner.device)
        if reason is None and _load_package(runner):
            return
        if reason is None and background:
            runner.warm_up()
            runner.compile_thread = threading.Thread(target=compile_in_background, args=(runner,),
                                                     name="pagedbackend-compile", daemon=True)
            runner.compile_thread.start()
            return
        if reason is None and _uses_package(runner) and _build_package(runner):
            return
        if reason is None:
            runner.compiled = CompiledStep(runner.model, runner.device, cpp_wrapper=config.cpp_wrapper)
            try:
                runner.warm_up()
                return
            except Exception as exc:   # a compiler that fails on this machine
                runner.compiled = None
                reason = f"torch.compile failed ({compile_failure(exc)})"
                logger.debug("pagedbackend: torch.compile failed", exc_info=True)
        logger.warning("pagedbackend: the model step runs eager: %s", reason)
    runner.warm_up()


def _uses_package(runner) -> bool:
    return runner.device.type == "cpu" and runner.config.step_package


def _load_package(runner) -> bool:
    """Serve the compiled step from its package when one is built for this
    model and machine (``step_package``); True when it serves."""
    if not _uses_package(runner):
        return False
    started = time.perf_counter()
    packaged = step_package.load(runner)
    if packaged is None:
        return False
    runner.compiled = packaged
    try:
        runner.warm_up()
    except Exception as exc:   # it loaded but cannot run here: compile as without one
        runner.compiled = None
        logger.warning("pagedbackend: the step package %s fails (%s)", packaged.path.name, compile_failure(exc))
        return False
    logger.info("pagedbackend: the compiled model step serves from its package %s (loaded in %.1f s)",
                packaged.path.name, time.perf_counter() - started)
    return True


def _build_package(runner) -> bool:
    """Build the step's package now and serve it (no dynamo guards per step); False if not."""
    try:
        step_package.build_in_subprocess(runner.config, niceness=0)
    except Exception as exc:
        logger.warning("pagedbackend: no step package (%s); compiling in this process", compile_failure(exc))
        return False
    return _load_package(runner)


def _scratch_cache(runner):
    """One block of K and V per layer, the runner's shapes: a warm-up beside
    served steps writes here, never a block that a sequence may hold."""
    return [(k[:1].clone(), v[:1].clone()) for k, v in runner.kv_caches]


def compile_in_background(runner) -> None:
    """Compile and warm up the step beside the eager steps that serve
    meanwhile, then hand it over (one attribute: the next step uses it).
    Its warm-up writes a scratch KV cache of its own, never a block that a
    sequence may hold. On CPU the step package is built in a process of
    its own at the lowest priority, then loaded; torch.compile in this
    process only if that fails."""
    started = time.perf_counter()
    if _uses_package(runner):
        try:
            step_package.build_in_subprocess(runner.config)
            packaged = step_package.load(runner)
            if packaged is None:
                raise RuntimeError("the package built is not the one this runner looks for")
            runner.warm_up((packaged.forward, packaged.logits), _scratch_cache(runner))
            runner.compiled = packaged
            logger.info("pagedbackend: the compiled model step serves from now on (its package built "
                        "in %.0f s beside eager steps)", time.perf_counter() - started)
            return
        except Exception as exc:
            logger.warning("pagedbackend: no step package (%s); compiling in this process", compile_failure(exc))
    interval = sys.getswitchinterval()
    # The compile is mostly Python holding the GIL, and an eager step needs
    # it back between hundreds of ops: at the default 5 ms switch interval
    # one step in ten waited seconds; at 50 us steps take 0.2 s (median, p90
    # 0.25 s) while the compile runs a third longer.
    sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)
    try:
        compiled = CompiledStep(runner.model, runner.device, cpp_wrapper=runner.config.cpp_wrapper)
        runner.warm_up((compiled.forward, compiled.logits), _scratch_cache(runner))
    except Exception as exc:   # a compiler that fails on this machine
        logger.debug("pagedbackend: torch.compile failed", exc_info=True)
        logger.warning("pagedbackend: the model step runs eager: torch.compile failed (%s)",
                       compile_failure(exc))
        return
    finally:
        sys.setswitchinterval(interval)
    runner.compiled = compiled
    logger.info("pagedbackend: the compiled model step serves from now on (compiled in %.0f s "
                "beside eager steps)", time.perf_counter() - started)
