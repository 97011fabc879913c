"""Control-machine effects, in one explicit step (:func:`.artifacts.prepare_control_artifacts`):
mesh keys, wheelhouses, offline .deb bundles (:mod:`.deb_bundles`, :mod:`.aptroot`), the
air-gapped bundle and its lock (:mod:`.airgap`, :mod:`.lockfile`) and the control copy of the
checkpoint served to the fleet (:mod:`.checkpoint_copy`). What the sandbox needs beyond a
real fleet comes in through one seam, :mod:`.stand_ins`."""


class ControlError(RuntimeError):
    """The control-machine step cannot make an artifact the deployment needs (one line, no traceback)."""
