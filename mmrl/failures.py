"""What the command line says about a failure: one line naming the file, field or row, and
what to do, for every failure class a user can meet and fix (not for bugs).

    message = explain(exc)   # None: not a known class; the CLI lets it raise (a bug: traceback)

The classes: the input errors mmrl raises itself (ValueError and its subclasses, RecipeError
and RunFolderError among them: their message is the line); the filesystem (a full disk, a
read-only folder, a permission, a link, any other OSError with its file); memory (host or
GPU); unreadable weights (safetensors); a config.json whose values transformers refuses;
sources out of reach (the hub, a connection); torch runtime errors whose cause is known (a
checkpoint that does not fit the model, a device-side assert); and under torchrun, another
rank's failure (every rank says the line). `mmrl --debug` shows the traceback instead
(mmrl/cli.py).
"""

from __future__ import annotations

import errno

from mmrl.errors import one_line

# errno -> what happened, and what to do about it.
_OS_ERRORS = {
    errno.ENOSPC: ("no space left on the device", "free space or choose a folder on another disk, then run again "
                   "(a run continues from its last checkpoint with trainer.resume=true)"),
    errno.EDQUOT: ("disk quota exceeded", "free space or choose a folder with room, then run again"),
    errno.EROFS: ("read-only file system", "choose a writable folder (trainer.output_dir for a run)"),
    errno.EACCES: ("permission denied", "choose a folder you may write to, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a folder you may write to, or fix its permissions"),
    errno.ELOOP: ("is a symbolic link", "mmrl does not write through links: remove the link or choose another "
                  "folder"),
    errno.EMFILE: ("too many open files", "raise the limit (ulimit -n) or lower data loading workers"),
}
# Names of exception classes (anywhere in the MRO) from libraries mmrl does not import here.
_UNREACHABLE = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "HfHubHTTPError", "RepositoryNotFoundError",
                "GatedRepoError", "RevisionNotFoundError", "EntryNotFoundError", "ConnectTimeout", "ReadTimeout",
                "ConnectionError", "MaxRetryError"}
_DATASETS = {"DatasetGenerationError", "DatasetNotFoundError", "DataFilesNotFoundError", "EmptyDatasetError"}
# Known causes of torch runtime errors: a part of the message -> what to do.
_WRITE_FELL_SHORT = ("a file could not be written whole (is the disk full?): free space or choose a folder on "
                     "another disk, then run again (a run continues from its last checkpoint with "
                     "trainer.resume=true)")
_TORCH_CAUSES = (
    ("Error(s) in loading state_dict", "the checkpoint does not fit the model (another family or size): check "
     "model.path, or resume with the recipe that wrote it"),
    ("size mismatch for", "the checkpoint does not fit the model (another size): check model.path"),
    ("device-side assert", "a token id or index out of range on the GPU (often a vocabulary that does not match the "
     "model); run again with CUDA_LAUNCH_BLOCKING=1 and --debug to find it"),
    ("out of memory", "lower algo.micro_batch_size or algo.micro_batch_tokens, rollout.samples_per_prompt, "
     "rollout.max_new_tokens or model.max_pixels, or turn model.gradient_checkpointing on"),
    # torch.save's zip writer when a write falls short (a full disk), in its own words.
    ("PytorchStreamWriter failed writing", _WRITE_FELL_SHORT),
    ("unexpected pos", _WRITE_FELL_SHORT),
    ("NCCL", "a collective between ranks failed (a rank died or the network dropped): see every rank's log and run "
     "again with trainer.resume=true"),
)


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def explain(exc: BaseException) -> str | None:
    """One line for a failure the user can act on (with the notes added to the exception on
    its way up, such as where a run kept its weights); None for anything else."""
    line = _explain(exc)
    notes = [one_line(note, whole=True) for note in getattr(exc, "__notes__", ())]
    return None if line is None else "; ".join([line, *notes])


def _explain(exc: BaseException) -> str | None:
    names = _names(exc)
    if "PeerFailed" in names:  # another rank's line, said on this one too (mmrl.parallel's Dist.together)
        return one_line(exc, whole=True)
    if names & {"OutOfMemoryError"} or isinstance(exc, MemoryError):
        where = "GPU" if "OutOfMemoryError" in names else "host"
        return f"out of {where} memory ({one_line(exc, 200)}): {_TORCH_CAUSES[3][1]}"
    if "SafetensorError" in names and ("No space left" in str(exc) or "os error 28" in str(exc)):
        what, todo = _OS_ERRORS[errno.ENOSPC]
        return f"a safetensors file cannot be written: {what}; {todo}"
    if "SafetensorError" in names:
        return (f"a safetensors file cannot be read ({one_line(exc, 200)}): it is cut short or not safetensors; "
                "write it again (a checkpoint: resume from an earlier one)")
    if names & _UNREACHABLE:
        return (f"a source cannot be reached ({one_line(exc, 300, typed=True)}): check the network or the hub id, or "
                "download it first and set HF_HUB_OFFLINE=1")
    if "StrictDataclassError" in names:  # transformers' config classes validate their values
        cause = exc.__cause__ or exc
        return (f"a model config is not valid ({one_line(cause, 300)}): fix the checkpoint's config.json "
                "(model.path) or model.config_overrides")
    if names & _DATASETS:
        return f"the dataset cannot be loaded ({one_line(exc, 300, typed=True)}): check data.* in the recipe"
    if isinstance(exc, OSError) and exc.errno in _OS_ERRORS:
        what, todo = _OS_ERRORS[exc.errno]
        return f"{_file_of(exc)}{what}; {todo}"
    if isinstance(exc, ValueError):
        return one_line(exc, whole=True)
    if isinstance(exc, OSError):
        detail = exc.strerror or one_line(exc, 200)
        return f"{_file_of(exc)}{detail}"
    if isinstance(exc, RuntimeError):
        text = str(exc)
        for part, todo in _TORCH_CAUSES:
            if part in text:
                return f"{one_line(exc, 300)}: {todo}"
    return None


def _file_of(exc: OSError) -> str:
    files = [f for f in (exc.filename, exc.filename2) if f]
    return f"{' -> '.join(str(f) for f in files)}: " if files else ""
