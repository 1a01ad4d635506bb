"""User reward functions: ``--reward_fn module:function`` or ``path/to/file.py:function`` (from Python, also the
function itself).

The function is called as ``fn(prompts, answers, **extra_columns)`` with lists of strings (and lists of the
dataset's extra column values; by keyword when it names parameters ``prompts`` and ``answers``), or, when it has a
parameter named ``completions``, as TRL calls reward functions: ``fn(prompts=..., completions=..., **extra_columns)``
(``call_arguments``); it returns one float per answer (an ``async def`` function: once awaited). A raised
exception or a non-finite value stops the run with the prompt that caused it: a silent 0 would train the policy on a
wrong reward.
"""
import asyncio
import collections.abc
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
import weakref

from dschat.data.pipeline import check_no_renamed_column_clash, extra_name, renamed_columns_note
from dschat.errors import MissingInputError, MissingModuleError, UsageError, excerpt
from dschat.report import counted
from dschat.utils.dist import print_rank_0

ALIASES = {"tiny": "dschat.tiny.scorer:score_batch"}


def check_reward_sources(args):
    """Step 3's rewards make sense before anything loads: some reward is given, and the bundled rule scorer (which
    gives 0 to any prompt it does not know, i.e. a constant reward and no learning) only scores the embedded data."""
    if not args.reward_fn and not args.reward_model_weight:
        raise UsageError("step3: --reward_model_weight 0 without --reward_fn leaves no reward to train on")
    if not args.reward_fn_weight and not args.reward_model_weight:  # (every score 0: every advantage too)
        raise UsageError("step3: --reward_fn_weight 0 with --reward_model_weight 0 leaves no reward to train on: "
                         "every score is 0 (the held-out evaluation still reports the function's, unweighted)")
    from dschat.data.pipeline import as_list
    from dschat.data.raw_datasets import is_tiny_data

    data = as_list(args.data_path)
    if isinstance(args.reward_fn, str) and ALIASES.get(args.reward_fn, args.reward_fn) == ALIASES["tiny"] \
            and not is_tiny_data(data):  # (the name tiny, or the shipped files' paths)
        raise UsageError(f"step3: --reward_fn tiny (the bundled rule scorer) knows only the embedded 'tiny' prompts "
                         f"and gives 0 to every other one, but --data_path is {' '.join(data)}; give your own "
                         f"function, e.g. --reward_fn my_rewards.py:score (train.py: inside --step3-args)")


def load_reward_fn(spec):
    """The callable named by ``spec``, or ``spec`` itself when it is one (a notebook's ``args["reward_fn"]``); a clear
    error when the module, file or function is missing."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        several = isinstance(spec, (list, tuple))
        raise UsageError(f"reward_fn is a {type(spec).__name__}: give one function (or 'module:function')"
                         + (", not several (TRL's reward_funcs): combine them in one that returns their sum per answer"
                            if several else ""))
    spec = ALIASES.get(spec, spec)
    if ":" not in spec:
        raise UsageError(f"--reward_fn {spec!r} must be 'module:function' or 'path/to/file.py:function'")
    target, name = spec.rsplit(":", 1)
    try:
        module = _loaded_module(spec, target, name)
    except SystemExit as stop:  # (it ended the run: sys.exit(0) with status 0, before any training)
        raise _exited_on_load(target, stop) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"--reward_fn: {target} has no function {name!r}")
    return fn


def _loaded_module(spec, target, name):
    """The module of a --reward_fn file (``target`` ending in .py) or module."""
    if target.endswith(".py"):
        if not os.path.exists(target):
            raise MissingInputError(f"--reward_fn file {target} does not exist")
        module = _file_module(target)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as error:
            if error.name is None or not (target == error.name or target.startswith(error.name + ".")):
                raise  # the module exists but imports something missing: that error says what
            raise MissingModuleError(f"--reward_fn {spec!r}: no module {target!r} (a file needs its .py path, "
                                     f"e.g. path/to/{target}.py:{name})") from None
        except SyntaxError as error:  # (one line, as for a file: not importlib's traceback)
            raise _unparsed("module", target, error) from None
    return module


def _exited_on_load(target, stop):
    """The UsageError of a --reward_fn file or module that called sys.exit while it loaded (a script's self-test, an
    argparse parser reading dschat's command line): its line, and the way out."""
    source = os.path.abspath(target) if target.endswith(".py") else _module_source(target)
    frames = traceback.extract_tb(stop.__traceback__)
    own = [frame for frame in frames if source and os.path.abspath(frame.filename) == source] or frames[-1:]
    at = f", at {_place(own[-1])}" if own else ""
    return UsageError(f"--reward_fn {'file' if target.endswith('.py') else 'module'} {target} called "
                      f"sys.exit({stop.code!r}) while it loaded{at}: its script code runs whenever it is imported; "
                      f"put that code under `if __name__ == \"__main__\":`")


_FILE_MODULES = {}  # (path, modification time) -> module: checked, then loaded, the file runs once (an edit: again)


def reward_fn_spec(fn):
    """``fn`` as a ``--reward_fn`` that loads it again (what training_args.json records for a notebook's function,
    for eval.py): a function of a module file of its own by the file's path (found from any folder), one of a package
    as ``package.module:name`` (found where the package imports); else None: a lambda, a nested function, a method, a
    callable object, or a function of the running script or notebook (``__main__``: loading that would run it)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not inspect.isfunction(fn) or "." in name or "<" in name or module in (None, "__main__"):
        return None
    # (a package's __init__ loaded as a file would lose its relative imports)
    if "." not in module and not hasattr(sys.modules.get(module), "__path__"):
        path = inspect.getsourcefile(fn)
        if path:
            return f"{os.path.abspath(path)}:{name}"
    return f"{module}:{name}"


def reward_fn_file(spec):
    """[absolute path, sha256 of its content] of the file a ``path/to/file.py:function`` or ``package.module:function``
    spec loads (the module's source file, found as an import would find it), else None (a notebook's function, a
    builtin, a file or module gone): what a run records, so that ``train.py --resume`` notices an edit."""
    from dschat.data.digests import file_digest

    spec = ALIASES.get(spec, spec) if isinstance(spec, str) else spec
    target = spec.rsplit(":", 1)[0] if isinstance(spec, str) and ":" in spec else ""
    path = target if target.endswith(".py") else _module_source(target)
    if not (path and os.path.isfile(path)):
        return None
    return [os.path.abspath(path), file_digest(path)]


def _module_source(name):
    """The source file of the module ``name`` (importing its parent packages only), else None."""
    if not name or not all(part.isidentifier() for part in name.split(".")):
        return None
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    origin = getattr(found, "origin", None)
    return origin if origin and origin.endswith(".py") else None


def recorded_reward_fn(value):
    """What a run records as its reward function: the spec as given, a function as ``reward_fn_spec`` gives it, else
    a marker (starting with "<") that says it was a Python object the tools cannot load."""
    if not callable(value):
        return value
    return reward_fn_spec(value) or f"<a Python object: {getattr(value, '__qualname__', type(value).__name__)}>"


def _file_module(target):
    key = (os.path.abspath(target), os.stat(target).st_mtime_ns)
    if key not in _FILE_MODULES:
        module_spec = importlib.util.spec_from_file_location(f"dschat_reward_fn_{abs(hash(key[0]))}", target)
        module = importlib.util.module_from_spec(module_spec)
        # registered under its name while it runs and after, as an import would: a dataclass of the file (under
        # `from __future__ import annotations`) looks its module up there, and pickle (a multiprocessing pool of
        # the function's helpers) finds the file's functions by it. (Only in this process and its forks: a pool
        # started with "spawn" or "forkserver" cannot import that name; give such a function as module:function.)
        sys.modules[module_spec.name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as error:
            sys.modules.pop(module_spec.name, None)
            if not isinstance(error, SyntaxError):  # (any other error's traceback says where it is)
                raise
            raise _unparsed("file", target, error) from None
        _FILE_MODULES[key] = module
    return _FILE_MODULES[key]


def _unparsed(kind, target, error):
    """The UsageError of a --reward_fn file or module (``kind``) that does not parse (or one it imports does): the
    file, line and text of the error."""
    return UsageError(f"--reward_fn {kind} {target}: {error.filename or target} line {error.lineno}: {error.msg}: "
                      f"{(error.text or '').strip()!r}")


def batch_extras(batch):
    """The dataset's extra columns of a prompt batch (lists, one value per row): what ``fn`` gets as keywords."""
    import torch

    return {k: v for k, v in batch.items() if not torch.is_tensor(v) and k not in ("prompt_text", "messages")}


def call_reward_fn(fn, prompts, answers, extras=None):
    """One float per answer from ``fn``; a failure is a UsageError naming the function and the prompt (the entry points
    print it as one line and exit with status 2: it is the user's function, not dschat, that needs the fix)."""
    name = _flag_name(fn)
    args, kwargs, how = call_arguments(fn, list(prompts), list(answers), extras or {})
    try:
        _signature(fn).bind(*args, **kwargs)
    except TypeError as ex:
        raise UsageError(f"{name} cannot be called as {how}: {ex}") from None
    try:
        returned = fn(*args, **kwargs)
        if inspect.isawaitable(returned):  # an async function, as TRL's reward functions may be
            returned = _awaited(returned)
        scores = _score_list(returned)  # (a generator's body runs here)
    except KeyboardInterrupt:  # Ctrl-C while it ran: the run is interrupted, as anywhere else
        raise
    except BaseException as ex:  # noqa: BLE001 (sys.exit() in the function, an async task cancelled: its errors too;
        # escaping, SystemExit ended this rank alone, with status 0 for sys.exit(0), and the others hung in the next
        # collective: step 3's `together` agrees on UsageErrors only)
        raise UsageError(f"{name} failed ({_described(ex)}{_where(ex, fn)}) on a batch starting with prompt "
                         f"{excerpt(prompts[0])}") from ex
    if scores is None:
        raise UsageError(f"{name} returned {_short(returned)}, not a list of {counted(len(answers), 'number')} (one "
                         f"score per answer), on a batch starting with prompt {excerpt(prompts[0])}")
    returned = scores
    if len(returned) != len(answers):
        raise UsageError(f"{name} returned {counted(len(returned), 'score')} for {counted(len(answers), 'answer')} "
                         f"(one per answer) on a batch starting with prompt {excerpt(prompts[0])}")
    scores = [_finite_number(score) for score in returned]
    for prompt, answer, score, value in zip(prompts, answers, returned, scores):
        if value is None:
            raise UsageError(f"{name} returned {excerpt(score)} for prompt {excerpt(prompt)} and answer "
                             f"{excerpt(answer)}: each score must be a finite number")
    return scores


def check_takes_columns(fn, columns, where, sources=None):
    """``fn`` can be called with the prompt ``columns`` of ``where`` (a split's ``PromptDataset.columns``): one with a
    parameter no column gives (TRL's ``solution=`` on data without it, a misspelt name) failed at the first reward,
    after the models loaded and the first answers were generated; a UsageError now, naming the columns there are.
    ``sources`` ({source: its columns}): one with columns that would come under one name is named."""
    for source, its_columns in (sources or {}).items():
        call_arguments(fn, [], [], {column: [] for column in its_columns}, where=source)
    args, kwargs, how = call_arguments(fn, [], [], {column: [] for column in columns})
    try:
        _signature(fn).bind(*args, **kwargs)
    except TypeError as ex:
        given = f"columns {', '.join(columns)}" if columns else "no columns besides the prompt"
        raise UsageError(f"{_flag_name(fn)} cannot be called as {how} on the {where}, which have {given}: "
                         f"{ex}") from None


def weighted_scores(fn, scores, weight, prompts, answers):
    """``weight`` x ``fn``'s ``scores`` (``call_reward_fn``'s) as step 3 holds its rewards, a float32 tensor. A score
    past float32's range (3.4e38; Python's float goes to 1.8e308), or made so by the weight, is the function's error
    naming the answer: it became an inf reward, refused later as "reward scores is not finite" naming neither."""
    import torch

    held = (torch.tensor(scores, dtype=torch.float64) * weight).float()
    for prompt, answer, score, value in zip(prompts, answers, scores, held.tolist()):
        if not math.isfinite(value):
            times = f" times --reward_fn_weight {weight}" if weight != 1 else ""
            raise UsageError(f"{_flag_name(fn)} returned {score!r} for prompt {excerpt(prompt)} and answer "
                             f"{excerpt(answer)}: {score!r}{times} is past the range of step 3's float32 rewards "
                             "(+-3.4e38)")
    return held


def _flag_name(fn):
    return f"--reward_fn {getattr(fn, '__name__', fn)!r}"


_EVENT_LOOP = {}  # process id -> the event loop async reward functions run in (a forked child starts its own)


def _awaited(awaitable):
    """What an async reward function's call returns once awaited. It runs in one event loop of dschat's, on a thread
    of its own, kept from call to call as TRL keeps its: a client the function keeps (an HTTP session for a judge
    model) stays bound to a loop that still runs, and a caller that runs a loop itself (a notebook) is not asked to
    start another on its thread, which asyncio refuses. It was refused as "returned coroutine ..." (never awaited)."""
    import threading

    loop = _EVENT_LOOP.get(os.getpid())
    if loop is None:
        loop = _EVENT_LOOP[os.getpid()] = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="dschat-reward-fn", daemon=True).start()

    async def result():  # (its exception handed over as it is: run_coroutine_threadsafe gives asyncio's TimeoutError
        try:  # and CancelledError as new ones, without the traceback that says where the function was)
            return await awaitable, None
        except BaseException as error:  # noqa: BLE001 (SystemExit, KeyboardInterrupt too: raised out of the loop,
            return None, error  # they ended its thread, and this call waited for a result forever)

    pending = asyncio.run_coroutine_threadsafe(result(), loop)
    try:
        returned, error = pending.result()
    except BaseException:  # Ctrl-C while it ran: it is cancelled, not left running on the loop's thread
        pending.cancel()
        raise
    if error is not None:
        raise error
    return returned


_RENAMED_SAID = {}  # id(fn) -> (a weak reference to fn, or None; the renamed column tuples said for it)


def _first_saying(fn, renamed):
    """Whether the note that the ``renamed`` columns come to ``fn`` as extra_<name> is yet to be said (from now on it
    is said). Kept by fn's id (a callable object may be unhashable) beside a weak reference to fn: a function that
    took the id of one gone (a notebook cell run again) is told from it, and gets its note; an entry goes with its
    function. A callable that takes no weak reference (a builtin, a class with __slots__) is known by its id alone."""
    entry = _RENAMED_SAID.get(id(fn))
    if entry is None or (entry[0] is not None and entry[0]() is not fn):
        entry = _RENAMED_SAID[id(fn)] = (_weak_reference(fn), set())
    if renamed in entry[1]:
        return False
    entry[1].add(renamed)
    return True


def _weak_reference(fn):
    key = id(fn)

    def forget(reference):  # (unless a new function's entry took the id)
        if _RENAMED_SAID.get(key, (None,))[0] is reference:
            del _RENAMED_SAID[key]

    try:
        return weakref.ref(fn, forget)
    except TypeError:
        return None


def _signature(fn):
    """``fn``'s signature; one that Python cannot read (some C callables) as ``(*args, **kwargs)``: called with all."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                                  inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def call_arguments(fn, prompts, answers, columns, where="the prompt batch"):
    """(args, kwargs, how) ``fn`` is called with. A function with a parameter named ``completions`` is called as TRL
    calls its reward functions, by keyword: ``fn(prompts=, completions=, **columns)``; one with parameters named
    ``prompts`` and ``answers`` by keyword too, whatever their order; any other as DeepSpeed-Chat-style code expects,
    ``fn(prompts, answers, **columns)`` (its second parameter named ``prompts``: an error, ``check_prompts_first``).
    A column named as one of those two arguments comes as ``extra_<name>`` (said once; one of that name as well, of
    ``where``'s data: a UsageError); columns the function has no parameter for are left out, unless it takes
    ``**kwargs``."""
    params = _signature(fn).parameters
    if "completions" in params:
        taken, args, how = ("prompts", "completions"), (), "fn(prompts=, completions=, **columns) (TRL's way)"
    elif _named(params, "prompts") and _named(params, "answers"):  # (in any order, or keyword-only)
        taken, args, how = ("prompts", "answers"), (), "fn(prompts=, answers=, **columns)"
    else:
        taken = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
        args, how = (prompts, answers), "fn(prompts, answers, **columns)"
        check_prompts_first(fn, taken)
    renamed = sorted(set(columns) & set(taken))
    check_no_renamed_column_clash({where: columns}, renamed, f"an argument of {_flag_name(fn)}")
    if renamed and _first_saying(fn, tuple(renamed)):
        print_rank_0(f"[reward_fn] {renamed_columns_note(renamed, repr(getattr(fn, '__name__', fn)))}: it is called "
                     f"as {how}")
    kwargs = {extra_name(k) if k in renamed else k: v for k, v in columns.items()}
    if not args:
        kwargs.update(zip(taken, (prompts, answers)))
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return args, kwargs, how


def _named(params, name):
    """Whether ``name`` is a parameter that can be given by keyword (not a positional-only one)."""
    return name in params and params[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY)


def check_prompts_first(fn, positional):
    """A function called by position whose second parameter is named ``prompts`` would get the answers there, and
    the prompts as its first (OpenRLHF's ``reward_func(queries, prompts, labels)``, or ``score(texts, prompts)``):
    each scored silently against the other's text."""
    if len(positional) == 2 and positional[1] == "prompts":
        hint = (" (OpenRLHF's queries are prompt + answer: prompts[i] + answers[i])"
                if positional[0] == "queries" else "")
        raise UsageError(f"{_flag_name(fn)}: its second parameter is named 'prompts' but would get the answers: a "
                         f"function is called as fn(prompts, answers, **columns), by position, unless it names its "
                         f"parameters prompts and answers (then by name, in any order) or completions (TRL's "
                         f"way){hint}")


def _score_list(returned):
    """What a reward function returned as a list of scores: a list, tuple, generator, 1-d array or tensor; else None
    (None, one number, a string, a dict such as OpenRLHF's {"rewards": ...}, a set: no order of answers)."""
    if hasattr(returned, "ndim"):  # numpy arrays and torch tensors (a 0-d one is one number)
        return list(returned) if returned.ndim == 1 else None
    if isinstance(returned, (str, bytes, collections.abc.Mapping, collections.abc.Set)):
        return None
    return list(returned) if isinstance(returned, collections.abc.Iterable) else None


def _short(value):
    """``value`` in one short line: an array's shape, else the start of its repr."""
    if hasattr(value, "shape"):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _finite_number(value):
    """``value`` as a float when it is a finite number (a numpy or 0-d torch one too; not a string), else None. A
    complex one is none: numpy's float() dropped its imaginary part (a warning, the score trained on), torch's raised
    a bare RuntimeError from here, as did a tensor that cannot be read (on the meta device)."""
    dtype = getattr(value, "dtype", None)
    if isinstance(value, (str, bytes, complex)) or getattr(dtype, "is_complex", False) \
            or getattr(dtype, "kind", "") == "c":
        return None
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError, RuntimeError, NotImplementedError):  # (an int past float's range,
        return None  # e.g. 10**400, overflows; a meta tensor has no value)
    return value if math.isfinite(value) else None


def _described(ex):
    """"TYPE: message", or the type alone for an exception without one (asyncio's TimeoutError): "TimeoutError: "."""
    return f"{type(ex).__name__}: {ex}" if str(ex) else type(ex).__name__


def _where(ex, fn):
    """", at FILE:LINE" of the innermost frame of the function's exception, and ", from FILE:LINE" of the innermost
    one in the function's own file where that is another (a library it called, json.loads' decoder.py: the line of
    the user's code that needs the fix was not said)."""
    frames = traceback.extract_tb(ex.__traceback__)
    if not frames:
        return ""
    own = [frame for frame in frames if frame.filename == _code_file(fn)]
    called = own[-1] if own and own[-1] is not frames[-1] else None
    return f", at {_place(frames[-1])}" + (f", from {_place(called)}" if called else "")


def _place(frame):
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


def _code_file(fn):
    """The file of ``fn``'s code (a callable object's ``__call__``, a functools.partial's function), else None."""
    for candidate in (fn, getattr(type(fn), "__call__", None), getattr(fn, "func", None)):
        code = getattr(inspect.unwrap(candidate), "__code__", None) if candidate is not None else None
        if code is not None:
            return code.co_filename
    return None
