"""k2fleet-test-double: stand-ins for the real inference engines.

These modules are TEST DOUBLES, installed only on k2fleet's GPU-less sandbox
fleet.  They accept the same argv as vLLM, SGLang and TensorRT-LLM (the SGLang
PD router is the real package, never a double),
refuse argv the real engine would not understand, perform a real TCP (or MPI)
rendezvous between the nodes of a multi-node deployment, and serve a tiny
deterministic OpenAI-compatible HTTP API.  They never load weights or touch a
GPU.  Everything they emit is marked ``k2fleet-test-double``.

Environment knobs (all optional):

* ``K2FLEET_DOUBLE_STARTUP_SECONDS`` -- simulated model load time (default 0);
  ``/health`` answers 503 meanwhile.
* ``K2FLEET_DOUBLE_RDZV_TIMEOUT`` -- seconds a rendezvous may take before the
  double exits 1 naming the peer address (default 300).
* ``K2FLEET_DOUBLE_GPUS_PER_NODE`` -- pretend GPUs per node (default 8).
* ``K2FLEET_DOUBLE_RDZV`` -- ``host:port`` for the TensorRT-LLM TCP
  rendezvous used under mpirun when mpi4py is not wanted / not installed.
"""

DOUBLE_NAME = "k2fleet-test-double"
__version__ = "0.1.0"
