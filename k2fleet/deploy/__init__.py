"""pyinfra glue: the HostState fact (:mod:`.facts`), the operations k2fleet adds
(:mod:`.operations`), one run's state (:mod:`.fleet_run`) and the roles
(:mod:`.roles`); ``deploys/kimi.py`` composes them."""
