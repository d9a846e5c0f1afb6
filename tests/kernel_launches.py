"""A recorder of Triton kernel launches for tests: each `kernel[grid](*args, **meta)` of the named kernels of a
module noted as (name, grid, args, meta), then launched as it was."""


def record_launches(monkeypatch, module, *names: str) -> list[tuple]:
    """Replaces each named JIT kernel of `module` (for the test's duration) by one that notes its launches in the
    returned list and then makes them."""
    launches = []

    class Recording:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append((self.name, grid, args, meta))
                return self.kernel[grid](*args, **meta)
            return launch

    for name in names:
        monkeypatch.setattr(module, name, Recording(name, getattr(module, name)))
    return launches
