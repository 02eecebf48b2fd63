"""``[web] redact``: payload and result fields nobody sees in the console.

A field is matched by its key at any depth (``card_number`` masks
``{"card": {"card_number": ...}}`` too), case-insensitively; its value,
whatever it is, becomes ``"***"``. Every page and API answer passes jobs
through ``job_dict`` and nothing else, so no view can forget it.
"""
MASK = "***"


class Redactor:
    def __init__(self, fields):
        self.fields = {f.lower() for f in fields}

    def value(self, value):
        if not self.fields:
            return value
        if isinstance(value, dict):
            return {k: MASK if isinstance(k, str) and k.lower() in self.fields else self.value(v)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value

    def covers(self, dotted_key):
        """Whether a payload filter key touches a redacted field (filtering on it would reveal its value)."""
        return any(part.lower() in self.fields for part in dotted_key.split("."))

    def job_dict(self, job):
        """A Job as the console shows it: every field, its payload, result and parents' results masked."""
        d = job.to_dict()
        d["attempts_allowed"] = job.attempts_allowed  # what the supervisor runs, not a producer's default
        d["payload"] = self.value(d["payload"])
        d["result"] = self.value(d["result"])
        if d.get("parents"):  # a workflow child carries its parents' results
            d["parents"] = {parent: [state, self.value(result)] for parent, (state, result) in d["parents"].items()}
        return d
