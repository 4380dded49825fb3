"""Disaggregated ranks: the last `parallel.rollout_ranks` processes only roll out, the
others only train, over the trajectory buffer.

    torchrun --nproc_per_node 4 -m mmrl.cli train RECIPE parallel.rollout_ranks=1 algo.max_staleness=1

With W processes and N rollout ranks, ranks 0..T-1 (T = W - N) are the train ranks: their
own process group, over which the engine shards (FSDP2) and every collective of their
`Dist` runs. Ranks T..W-1 each hold a full, unsharded copy of the policy (an engine of one
process) and decode. Rollout rank j samples the prompt shares of train ranks j, j + N, ...
(the step's prompts split as a run of T ranks splits them), scores them, records their
behaviour log-probs under its weights and writes each share as the Parquet file the train
rank's buffer reads (`mmrl.buffer.store`; the file names are those the train rank would
write itself). A train rank waits for the file of its next batch and trains on it. The
rollout backend is the recipe's: `hf`, `hf_compiled` or `vllm` (an in-process engine per
rollout rank, which takes each weights version the rank loads through its `sync`);
with `algo.behaviour: sampler` the behaviour log-probs are the backend's own.

Batches travel through the run folder, not through process-group messages: the buffer
persists them there anyway, a train rank that stops early (a target accuracy, a time budget)
leaves no send waiting for a receive, and a resumed run finds the batches it had received
and not trained on where it left them. Several nodes then need the run folder on a shared
file system. Weights travel through the process group: before the step that trains with
weights version v (v updates done), train rank 0 broadcasts them over a group of itself
and the rollout ranks (gloo on CPU, NCCL on GPU), tensor by tensor, each gathered from the
shards (`DTensor.full_tensor`, collective over the train ranks) just before it is sent,
after a header with the version and before a checksum of their bits, which each rollout
rank checks once it has loaded them into its copy.

Staleness: before each batch a rollout rank loads every version sent since its last one
(it awaits the next header in the background, so it sees one without waiting), and it
samples the batch of step b (b = 1, 2, ...) only with weights of version >= b - 1 -
`algo.max_staleness`, waiting for them when it is that far ahead, so no batch a train rank
takes is older than the bound (`tests/test_disaggregated.py` checks the versions in
metrics.jsonl). A resumed run starts from what the train ranks send first: the
checkpoint's weights version, its data position and the batches it had received.

Each train step logs `buffer/version` (the version that sampled its batch),
`buffer/wait_seconds` (waiting for the batch's file) and `sync/seconds` (sending the
weights). Train rank 0 records each version it sent and its checksum in
`buffer/weights_sent.jsonl`, each rollout rank what it loaded in
`buffer/weights_rank<R>.jsonl`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist

from mmrl.buffer.schedule import BUFFER_FOLDER, BufferedSteps, behaviour_log_probs, rebuild_for, sampler_log_probs
from mmrl.buffer.store import RolloutBatch, TrajectoryBuffer, read_batch, write_batch
from mmrl.buffer.trainer_view import TrainerView
from mmrl.config import Recipe, RecipeError
from mmrl.data import Position
from mmrl.parallel import Dist, init_distributed

# How often a train rank looks for the file of the batch it waits for.
POLL_SECONDS = 0.02
SENT_LOG = "weights_sent.jsonl"


@dataclass(frozen=True)
class Layout:
    """Which process does what: `world_size` processes, the last `rollout_ranks` roll out."""

    world_size: int
    rollout_ranks: int

    @property
    def train_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.train_ranks

    def served_by(self, rank: int) -> list[int]:
        """The train ranks whose batches rollout rank `rank` samples."""
        return list(range(rank - self.train_ranks, self.train_ranks, self.rollout_ranks))


def layout_problem(world_size: int, rollout_ranks: int) -> str | None:
    """Why `rollout_ranks` of `world_size` processes cannot run (one line), or None."""
    if rollout_ranks >= world_size:
        return (f"parallel.rollout_ranks: {rollout_ranks} leaves no train rank among the {world_size} process(es) "
                f"(torchrun --nproc_per_node): start more than {rollout_ranks}")
    train = world_size - rollout_ranks
    if rollout_ranks > train:
        return (f"parallel.rollout_ranks: {rollout_ranks} rollout ranks for {train} train rank(s): each rollout rank "
                f"samples the batches of whole train ranks, so at most {world_size // 2} of the {world_size} "
                "processes")
    return None


class RunnableTrainer(TrainerView, Protocol):
    """A trainer `train` runs: on a train rank its schedule is replaced by the batches the
    rollout ranks send, then it fits."""

    trajectories: BufferedSteps

    def fit(self) -> dict[str, Any]: ...


def train(recipe: Recipe, make_trainer: Callable[[Recipe, Dist], RunnableTrainer]) -> dict:
    """Run `recipe` on this process's side (`mmrl.trainer.train` calls it when
    `parallel.rollout_ranks` is set); `make_trainer(recipe, dist)` builds a Trainer.
    Returns the train ranks' summary ({} on a rollout rank)."""
    world = init_distributed()
    layout = Layout(world.world_size, recipe.parallel.rollout_ranks)
    problem = layout_problem(world.world_size, layout.rollout_ranks)
    if problem:
        raise RecipeError(problem)
    # Every process creates every group, in the same order (torch.distributed's rule).
    train_group = torch_dist.new_group(list(range(layout.train_ranks)))
    sync_group = torch_dist.new_group([0, *range(layout.train_ranks, layout.world_size)])
    if layout.is_rollout(world.rank):
        # One process's engine: the full weights, unsharded. No reference model: a rollout
        # rank computes no KL.
        dist = Dist(rank=world.rank, world_size=1, local_rank=world.local_rank, device=world.device, mesh=None)
        alone = recipe.model_copy(update={"algo": recipe.algo.model_copy(update={"kl_coef": 0.0})})
        RolloutRank(make_trainer(alone, dist), layout, sync_group).run()
        summary: dict = {}
    else:
        mesh = None
        if layout.train_ranks > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(train_group, world.device.type, mesh_dim_names=("dp",))
        dist = Dist(rank=world.rank, world_size=layout.train_ranks, local_rank=world.local_rank,
                    device=world.device, mesh=mesh, group=train_group)
        trainer = make_trainer(recipe, dist)
        refuse_synchronized_generate(trainer)
        steps = train_steps(trainer, sync_group)
        trainer.trajectories = steps
        summary = trainer.fit()
        steps.close(trainer.step)
    # No process leaves while another still talks to it; the groups go down in order.
    torch_dist.barrier()
    torch_dist.destroy_process_group()
    return summary


def refuse_synchronized_generate(trainer: TrainerView) -> None:
    """Plain `generate` under FSDP2 steps every process together through the default group
    (transformers' `synced_gpus`), which the rollout ranks are not in: refuse the train
    ranks' validation and evaluation on it."""
    dist = trainer.dist
    evaluates = trainer.validation_set is not None or trainer.eval_set is not None
    if dist.distributed and evaluates and trainer.settled.rollout_backend == "hf":
        raise RecipeError(f"parallel.rollout_ranks: the {dist.world_size} train ranks validate with plain generate "
                          "under FSDP2, which synchronizes every process, rollout ranks included; set "
                          "rollout.backend=hf_compiled, or no data.validation / data.eval")


# -- weights: train rank 0 -> rollout ranks ----------------------------------------------------
def fold(total: int, position: int, tensor: torch.Tensor) -> int:
    """`total` with the `position`-th tensor's bits added: integer sums, so the same on any
    device and in any summation order, and a sender and a receiver compare exactly."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    return (total + position * int(bits.to(torch.int64).sum())) % (1 << 61)


def checksum(tensors: Iterable[torch.Tensor]) -> int:
    """An exact fingerprint of the tensors' bits, in order (`fold`)."""
    total = 0
    for position, tensor in enumerate(tensors, start=1):
        total = fold(total, position, tensor)
    return total


def _weights(engine) -> list[tuple[str, torch.Tensor]]:
    """The engine's model state (names as `state_dict` gives them, DTensor shards under
    FSDP2), each tensor once (tied weights under their first name)."""
    seen: set[int] = set()
    out = []
    for name, value in engine.model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            out.append((name, value))
    return out


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from the train ranks' shards (collective) for a DTensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


class WeightSender:
    """The train ranks' side: every train rank gathers each tensor (collective), rank 0
    sends it at once, so no rank holds more than one full tensor beside its shards."""

    def __init__(self, engine, dist: Dist, group, log: Path):
        self.engine = engine
        self.dist = dist
        self.group = group
        self.log = log
        self.version: int | None = None  # the version sent last

    def start(self, info: dict) -> None:
        """Tell the rollout ranks where the run stands (`info`) and the weights' layout."""
        names = [(name, tuple(value.shape), str(value.dtype).removeprefix("torch."))
                 for name, value in _weights(self.engine)]
        if self.dist.is_main:
            torch_dist.broadcast_object_list([{**info, "weights": names}], src=0, group=self.group)

    @torch.no_grad()
    def publish(self, version: int) -> float:
        """Send weights `version` (the engine's current ones): a header, each tensor, their
        checksum. Returns the seconds it took."""
        began = time.perf_counter()
        main, device = self.dist.is_main, self.dist.device
        if main:
            torch_dist.broadcast(torch.tensor([version, 0], dtype=torch.int64, device=device), src=0,
                                 group=self.group)
        total = 0
        for position, (_, value) in enumerate(_weights(self.engine), start=1):
            full = _full(value)
            if main:
                full = full.to(device).contiguous()
                torch_dist.broadcast(full, src=0, group=self.group)
                total = fold(total, position, full)
            del full
        if main:
            torch_dist.broadcast(torch.tensor([total], dtype=torch.int64, device=device), src=0, group=self.group)
            with self.log.open("a") as out:
                out.write(json.dumps({"version": version, "checksum": total}) + "\n")
        self.version = version
        return time.perf_counter() - began

    def stop(self) -> None:
        """Tell the rollout ranks that no version follows."""
        if self.dist.is_main:
            torch_dist.broadcast(torch.tensor([-1, 1], dtype=torch.int64, device=self.dist.device), src=0,
                                 group=self.group)


class WeightReceiver:
    """A rollout rank's side: the start, then each version into its engine's model. The
    next version's header is always awaited in the background (an asynchronous
    broadcast), so between batches the rank can see whether one was sent (`arrived`)
    without waiting, and the sender waits for it one batch at most."""

    def __init__(self, engine, device: torch.device, group, log: Path):
        self.engine = engine
        self.device = device
        self.group = group
        self.log = log
        self.layout: list[tuple[str, tuple, str]] = []
        self._header = torch.zeros(2, dtype=torch.int64, device=device)
        self._header_work = None

    def start(self) -> dict:
        """Where the run stands (`WeightSender.start`); the weights' layout must be this
        rank's model's."""
        box = [None]
        torch_dist.broadcast_object_list(box, src=0, group=self.group)
        info = box[0]
        self.layout = info["weights"]
        own = dict(_weights(self.engine))
        sent = {name for name, _, _ in self.layout}
        unknown, missing = sorted(sent - set(own)), sorted(set(own) - sent)
        if unknown or missing:
            raise RuntimeError(f"the rollout rank's model does not match the train ranks': it lacks {len(unknown)} "
                               f"of their weights {unknown[:1]} and has {len(missing)} more {missing[:1]}")
        self._await_header()
        return info

    def _await_header(self) -> None:
        self._header_work = torch_dist.broadcast(self._header, src=0, group=self.group, async_op=True)

    def arrived(self) -> bool:
        """Whether the train ranks have sent the next version (or the word to stop)."""
        return self._header_work.is_completed()

    @torch.no_grad()
    def receive(self) -> int | None:
        """The next version sent, loaded into the model (None: the train ranks are done)."""
        self._header_work.wait()
        version, stop = (int(x) for x in self._header.tolist())
        if stop:
            return None
        own = dict(_weights(self.engine))
        loaded = 0
        for position, (name, shape, dtype) in enumerate(self.layout, start=1):
            value = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            torch_dist.broadcast(value, src=0, group=self.group)
            own[name].copy_(value)
            # What the copy holds now, in the sent dtype: the sender's bits when it matches.
            loaded = fold(loaded, position, own[name].to(value.dtype))
        expected = torch.zeros(1, dtype=torch.int64, device=self.device)
        torch_dist.broadcast(expected, src=0, group=self.group)
        if loaded != int(expected):
            raise RuntimeError(f"weights version {version} arrived with checksum {loaded}, sent with {int(expected)}")
        with self.log.open("a") as out:
            out.write(json.dumps({"version": version, "checksum": loaded}) + "\n")
        self._await_header()
        return version


# -- the train ranks' schedule ------------------------------------------------------------------
class ReceivedSteps(BufferedSteps):
    """The batch each train step takes: the next one a rollout rank wrote, after sending
    the rollout ranks the weights the step starts from."""

    def __init__(self, buffer: TrajectoryBuffer, *, max_staleness: int, total_steps: Callable[[], int],
                 receive: Callable[[Path], RolloutBatch], rebuild: Callable, sender: WeightSender,
                 start_info: Callable[[], dict]):
        # Nothing is produced here: `_fill` receives what the rollout ranks wrote.
        super().__init__(buffer, max_staleness=max_staleness, total_steps=total_steps, produce=lambda: None,
                         rebuild=rebuild)
        self.receive = receive
        self.sender = sender
        self.start_info = start_info
        self._sync_seconds = 0.0
        self._wait_seconds = 0.0

    def next(self, done: int) -> tuple[RolloutBatch, dict[str, float]]:
        self._sync_seconds = self._publish(done)
        self._wait_seconds = 0.0
        batch, metrics = super().next(done)
        return batch, {**metrics, "buffer/version": float(batch.version), "buffer/wait_seconds": self._wait_seconds,
                       "sync/seconds": self._sync_seconds}

    def _fill(self, done: int) -> None:
        """Wait for the next batch's file (the bound was kept when it was sampled)."""
        while not self.buffer.pending:
            began = time.perf_counter()
            batch = self.receive(self.buffer.batch_file(self.buffer.produced + 1))
            self._wait_seconds += time.perf_counter() - began
            self.buffer.put(batch, on_disk=True)

    def close(self, done: int) -> None:
        """After the last step: the final weights, then the word to stop."""
        self._publish(done)
        self.sender.stop()

    def _publish(self, done: int) -> float:
        """Send weights version `done` unless sent already (the run's start first, once);
        the seconds it took."""
        if self.sender.version is None:
            self.sender.start(self.start_info())
        return self.sender.publish(done) if self.sender.version != done else 0.0


def train_steps(trainer: TrainerView, sync_group) -> ReceivedSteps:
    """A train rank's schedule: batches from the rollout ranks' files, weights to them."""
    dist = trainer.dist
    folder = trainer.output_dir / BUFFER_FOLDER
    buffer = TrajectoryBuffer(folder, rank=dist.rank, ranks=dist.world_size, main=dist.is_main)
    rebuild = rebuild_for(trainer)

    def receive(path: Path) -> RolloutBatch:
        while not path.is_file():
            time.sleep(POLL_SECONDS)
        table, metadata = read_batch(path)
        batch = rebuild(table, metadata)
        trainer.position = Position(*batch.data_end)  # a checkpoint continues after it
        return batch

    def start_info() -> dict:
        folder.mkdir(parents=True, exist_ok=True)
        return {"version": trainer.step, "produced": buffer.produced, "position": list(trainer.position)}

    return ReceivedSteps(buffer, max_staleness=trainer.recipe.algo.max_staleness,
                          total_steps=lambda: trainer.recipe.trainer.steps, receive=receive, rebuild=rebuild,
                          sender=WeightSender(trainer.actor, dist, sync_group, folder / SENT_LOG),
                          start_info=start_info)


# -- a rollout rank ----------------------------------------------------------------------------
class RolloutRank:
    """Sample, score and write the batches of the train ranks this rank serves, loading
    each weights version the train ranks send between batches (module docstring)."""

    def __init__(self, trainer: TrainerView, layout: Layout, sync_group):
        self.trainer = trainer
        self.layout = layout
        rank = trainer.dist.rank
        self.serves = layout.served_by(rank)
        self.folder = trainer.output_dir / BUFFER_FOLDER
        self.weights = WeightReceiver(trainer.actor, trainer.dist.device, sync_group,
                                      self.folder / f"weights_rank{rank}.jsonl")
        # The train ranks' file names (`TrajectoryBuffer.batch_file`).
        self.files = {served: TrajectoryBuffer(self.folder, rank=served, ranks=layout.train_ranks)
                      for served in self.serves}

    def run(self) -> None:
        trainer, recipe = self.trainer, self.trainer.recipe
        info = self.weights.start()
        version = self._receive()
        if version is None:
            return
        shares = self.layout.train_ranks
        per_rank = max(1, recipe.data.prompts_per_step // shares)
        dataset = trainer.train_set
        batches = dataset.batches(per_rank * shares, seed=recipe.data.shuffle_seed, start=Position(*info["position"]))
        index_of = {source: index for index, source in enumerate(dataset.source_rows)}
        name = getattr(dataset, "name", "") or ""
        temperature = recipe.rollout.temperature or 1.0
        sampler = recipe.algo.behaviour == "sampler"
        for number in range(info["produced"] + 1, recipe.trainer.steps + 1):
            # The newest weights sent, and at least those the bound asks for.
            while version < number - 1 - recipe.algo.max_staleness or self.weights.arrived():
                version = self._receive()
                if version is None:
                    return  # the train ranks stopped early
            chosen = next(batches)
            trainer.position = chosen.end
            trainer.step = number - 1  # the step the batch is for (`Trainer.roll_out_batch` names it)
            rows = [dataset.source_rows[i] for i in chosen.indices]
            for served in self.serves:
                batch = trainer.roll_out_batch(prompts=(chosen.samples[served::shares], rows[served::shares]))
                batch.version = version
                batch.indices = [index_of[row] for row in batch.rows]
                batch.dataset = name
                batch.batch_id = number
                # The sampler's own log-probs (`algo.behaviour: sampler`) save the rank a forward pass.
                batch.behaviour_logp = sampler_log_probs(batch) if sampler else \
                    behaviour_log_probs(trainer.update, batch, temperature)
                write_batch(self.files[served].batch_file(number), batch)
        while version is not None:  # the remaining versions, the last one included
            version = self._receive()

    def _receive(self) -> int | None:
        """The next weights version, loaded and handed to the rollout backend (vLLM keeps
        its own copy); None once the train ranks are done."""
        version = self.weights.receive()
        if version is not None:
            self.trainer.rollout.sync(self.trainer.actor)
        return version


__all__ = ["Layout", "ReceivedSteps", "RolloutRank", "WeightReceiver", "WeightSender", "checksum", "fold",
           "layout_problem", "refuse_synchronized_generate", "train", "train_steps"]
