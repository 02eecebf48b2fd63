"""A reload (SIGHUP), from the signal to the new generation, without holding the loop.

The handler files are first imported in a throwaway process (``trial``). The loop
serves on meanwhile: replies, hard timeouts, the health socket, claims, the
watchdog's pings. It looks at the trial again when the trial's process ends or its
``supervisor.import_timeout`` runs out. Only once the trial passed does the master
import the files itself and start the new generation. SIGHUPs that arrive during a
reload make one more reload after it, not one each; SIGTTIN and SIGTTOU wait for
its end. A stop ends a trial under way and fails its reload.
"""
import logging
import selectors

from .. import config, logs, registry, scheduler, toolkit
from ..errors import ConfigError

log = logging.getLogger("tangguh.arbiter")

# Settings a reload may not change: what they name was opened at start (the locks' Redis too).
# redis_wait_replicas before url, which carries it (config.with_wait_replicas): the key changed is named.
RESTART_ONLY = (("broker", "redis_wait_replicas"), ("broker", "url"), ("toolkit", "redis_url"),
                ("supervisor", "socket"), ("supervisor", "socket_mode"), ("supervisor", "socket_group"), ("metrics", "listen"))


class Reloads:
    def __init__(self, m, begin_trial):
        self.m = m  # the arbiter
        self.begin_trial = begin_trial  # trial.Trial: (folder, generation, heartbeat, timeout)
        self.under_way = None  # (the new config, its trial.Trial)
        self.again = False  # a SIGHUP came during this reload: one more once it is over
        # SIGTTIN/SIGTTOU that came during it: acted on once it is over, or the new generation's
        # worker count (the config's) would undo them.
        self.held = []

    def request(self):
        m = self.m
        if m.stopping:
            log.info("reload ignored: the supervisor is stopping", extra={"event": "reload_ignored"})
            return
        if self.under_way is not None:
            self.again = True
            return
        m.status.notifier.reloading()
        try:
            cfg = config.load(m.cfg.path)
            toolkit.check_urls(cfg.toolkit)
            for section, key in RESTART_ONLY:
                if getattr(getattr(cfg, section), key) != getattr(getattr(m.cfg, section), key):
                    raise ConfigError(f"{section}.{key}: changing it needs a restart, not a reload")
            tried = self.begin_trial(cfg.supervisor.handlers, m.generation + 1, m.heartbeat,
                                     cfg.supervisor.import_timeout)
        except Exception as exc:  # noqa: BLE001 - whatever a reload meets, the running generation goes on
            return self.failed(exc)
        self.under_way = (cfg, tried)
        if tried.leader is not None:
            m.pool.others[tried.leader] = tried.exited  # the pool reaps every child, this one too
        for fd in tried.fds():
            m.selector.register(fd, selectors.EVENT_READ, lambda _mask: self.step())
        self.step()

    def fds(self):
        """The descriptors of the trial under way (a child forked meanwhile closes them)."""
        return [] if self.under_way is None else self.under_way[1].fds()

    def due_at(self):
        return None if self.under_way is None else self.under_way[1].due_at()

    def step(self):
        """Once the trial under way is over: the new generation, or the reload failed."""
        if self.under_way is None:
            return
        cfg, tried = self.under_way
        problem = tried.poll()
        if problem is None:
            return
        self._end_trial()
        try:
            if problem:
                raise registry.HandlerLoadError(problem)
            # The master's own import holds the loop, and its pings, as long as the trial took: a full
            # watchdog period from now, not what is left of one (WatchdogSec= cut a slow reload short).
            self.m.status.notifier.watchdog(now_anyway=True)
            try:
                handlers, dropped = registry.reload_handlers(cfg.supervisor.handlers, self.m.generation + 1,
                                                             self.m.handlers)
            finally:
                self.m.catch_signals()  # a module may have set its own, failing or not
            scheduler.check_schedules(cfg, handlers)
        except Exception as exc:  # noqa: BLE001 - as above
            return self.failed(exc)
        self.apply(cfg, handlers, dropped)
        self.ended()

    def stop(self):
        """A stop signal: the trial under way ends, its reload fails, none follows."""
        self.again, self.held = False, []
        if self.under_way is not None:
            self._end_trial()
            self.failed(registry.HandlerLoadError("supervisor.handlers: the reload gave way to a stop signal"))

    def failed(self, exc):
        m = self.m
        m.reload_error = registry.reload_error_text(exc)
        m.status.count("reload", "failed")
        log.error("reload failed, keeping generation %d: %s", m.generation, m.reload_error,
                  extra={"event": "reload_failed", "generation": m.generation})
        self.ended()

    def ended(self):
        self.m.status.reloaded()
        self.m.signals.extend(self.held)
        self.held = []
        if self.again:
            self.again = False
            self.request()

    def _end_trial(self):
        _, tried = self.under_way
        for fd in tried.fds():
            self.m.selector.unregister(fd)  # before its close: the number may be another's next
        tried.close()
        self.m.pool.others.pop(tried.leader, None)
        self.under_way = None

    def apply(self, cfg, handlers, dropped):
        """The new generation: its config and handlers everywhere; the old children retire."""
        m = self.m
        m.cfg, m.handlers = cfg, handlers
        toolkit.preload(cfg.toolkit)  # a database_url changed by the reload: its driver for the new children
        m.generation += 1
        m.settings_cache, m.reload_error = {}, None
        m.dispatcher.configure(cfg, handlers)
        m.periodic.configure(cfg, handlers)
        registry.forget_generation(m.generation - 1)  # once nothing here holds its handlers
        m.pool.cfg, m.pool.generation, m.pool.target = cfg.supervisor, m.generation, cfg.supervisor.workers
        m.heartbeat.lease_seconds, m.heartbeat.queues = cfg.broker.lease_seconds, list(cfg.broker.queues)
        m.heartbeat.interval = cfg.broker.heartbeat_seconds
        logs.reconfigure(cfg.log.level, cfg.log.format)
        m.pool.retire_all(older_than=m.generation)
        m.status.set_title()
        m.status.count("reload", "ok")
        log.log(logging.WARNING if dropped else logging.INFO, "reloaded: generation %d with %d handler types, %d"
                " workers (the config's)%s", m.generation, len(handlers), m.pool.target, registry.dropped_note(dropped),
                extra={"event": "reload", "generation": m.generation, "dropped_types": dropped})
