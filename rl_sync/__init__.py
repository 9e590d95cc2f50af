"""rl_sync: versioned weight pushes from trainers to generators, built on :mod:`transport`.

Nothing is exported yet: the publisher/subscriber API is being built on top of
the transport's public API (see the project's issue tracker). This package
uses only ``transport``'s public names; ``transport`` never imports it.
"""

__all__: list[str] = []
