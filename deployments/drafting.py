"""How a target model's replica reaches its draft model (``speculative: {drafter: model, draft: <name>}``).

The draft model is another model of the same app: the ingress itself when the ingress hosts it (the app's
first model), else its ``LLMServer:<name>`` deployment. Its handle is looked up by name on first use, not
bound at build time: the ingress already holds handles to the model deployments, and a binding back to it
would make the application graph a cycle. Draft calls carry their sequence's whole context, so whichever
replica of the draft deployment Serve picks can answer (app/spec/remote.py).
"""

from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle

INGRESS_DEPLOYMENT = "OpenAIIngress"


class HandleDraftClient:
    """``await client(call)``: send one DraftCall to the deployment serving its drafter's draft model."""

    def __init__(self, deployments: dict[int, str]) -> None:
        self._deployments = dict(deployments)  # drafter index -> deployment name
        self._handles: dict[int, DeploymentHandle] = {}

    async def __call__(self, call):
        return await self._handle(call.drafter).propose.remote(call)

    def _handle(self, drafter: int) -> DeploymentHandle:
        handle = self._handles.get(drafter)
        if handle is None:
            name = self._deployments.get(drafter)
            if name is None:
                raise LookupError(f"drafter {drafter} has no draft deployment")
            handle = serve.get_deployment_handle(name, serve.get_replica_context().app_name)
            self._handles[drafter] = handle
        return handle
