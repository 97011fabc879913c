"""What every engine renderer shares (:mod:`.common`). The renderers themselves are the engines'
own (``k2fleet/planning/engines/<name>/render.py``): ``render(dep)`` takes a resolved Deployment
and yields ``(host name, Service)`` pairs, or ``(host name, {path: content})`` for files a host
needs without a service of its own. :mod:`k2fleet.planning.planner` collects them."""
