"""Prompt sets for ``tsspec bench``: the kinds of text speculation's payoff depends on.

Speculation wins when the next tokens are predictable from something cheap: the prompt itself
(n-gram lookup), a small model, a draft head. So the built-in workloads span that axis,
12 prompts each (the prompts, not the repetitions, are the samples ``tsspec bench``'s intervals
rest on):

* ``prose``     free-form writing, from one-line requests to detailed briefs; little to copy,
                the hardest case for drafting;
* ``factual``   lists and well-known facts (primes, capitals, elements); a small model knows them;
* ``code``      code completion; boilerplate and repeated identifiers;
* ``grounded``  repeat / edit / summarise a passage that is *in the prompt* (150-300 words or a
                code block), so the answer quotes it and prompt-lookup drafting shines;
* ``code-edit`` (only when named: ``-w code-edit``) a source file and a change asked of it, the
                whole file back: the answer quotes the file and writes new code where the change
                goes, so lookup and a model each have their part (what a cascade is for);
* ``agent``     (only when named: ``-w agent``) one tool-routing instruction, then requests that
                each want a JSON tool call about a different input; what repeats is across
                requests (the JSON shape, tool names, argument keys), which the suffix
                speculator carries from one request to the next and per-sequence n-gram cannot.

``load_prompts(path)`` reads user prompts: a ``.jsonl`` file (one ``{"id": ..., "text": ...}``
object per line; ``id`` optional) or any other text file (prompts separated by blank lines).
Errors raise ``tsspec.errors.BadInput`` naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tsspec.errors import BadInput
from tsspec.paths import read_user_file


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[Prompt] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise BadInput(f"workload {self.name!r}: no prompts")
        ids = [p.id for p in self.prompts]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise BadInput(f"workload {self.name!r}: duplicate prompt id(s) {', '.join(dup)}")


# ----------------------------------------------------------------------------- built-in prompts

_PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle that seems to "
    "have been written by her future self.",
    "Describe a busy night market in a coastal city, focusing on the sounds, smells and the people "
    "who work there.",
    "Write a letter from a retired engineer to his granddaughter explaining why he still repairs "
    "old radios instead of buying new ones.",
    "Explain, in a few friendly paragraphs, why the sky turns red and orange at sunset, as if "
    "talking to a curious ten-year-old.",
    "Write an opinion piece arguing that small towns should invest in public libraries rather "
    "than new parking lots.",
    "Write a poem about rain.",
    "Tell me about your ideal weekend.",
    "Write the opening page of a mystery novel set on a night train crossing the Alps in winter. "
    "Introduce the detective, the victim and at least two suspects, and end on a cliffhanger.",
    "Describe the life of a honeybee colony over one year, season by season, in the style of a "
    "nature documentary narrator.",
    "Write a dialogue between two old friends who meet by chance at an airport after twenty years, "
    "one of whom has become famous.",
    "Imagine you are a tree that has stood in the same city park for three hundred years. Describe "
    "what you have seen change around you.",
    "Write a persuasive speech for a school assembly encouraging students to learn a musical "
    "instrument, with three concrete reasons and a short personal anecdote.",
]

_FACTUAL = [
    "List the first 40 prime numbers, separated by commas.",
    "List the countries of the European Union together with their capital cities, one per line, "
    "in the form 'Country: Capital'.",
    "List the first 30 elements of the periodic table with their symbols and atomic numbers, one per line.",
    "List the planets of the solar system in order from the Sun, and for each give its number of "
    "known major moons and whether it has rings.",
    "List the months of the year with the number of days in each, then list the days of the week "
    "in English, French and German.",
    "Write out the multiplication table for 7 from 7 x 1 up to 7 x 20, one line per product.",
    "Count from 1 to 60 in words.",
    "List the US states in alphabetical order with their two-letter postal abbreviations.",
    "Give the Roman numerals for every year from 1990 to 2025.",
    "List the letters of the Greek alphabet in order, with the name of each letter spelled out.",
    "List the powers of two from 2^0 to 2^32, one per line, in the form '2^n = value'.",
    "List the books of the Old Testament in order.",
]

_CODE = [
    "Complete the following Python module. Implement every method.\n\n"
    "```python\n"
    "class LRUCache:\n"
    '    """A fixed-capacity least-recently-used cache."""\n\n'
    "    def __init__(self, capacity: int) -> None:\n"
    "        ...\n\n"
    "    def get(self, key):\n"
    "        ...\n\n"
    "    def put(self, key, value) -> None:\n"
    "        ...\n\n"
    "    def __len__(self) -> int:\n"
    "        ...\n"
    "```",
    "Write a C function `int parse_csv_line(const char *line, char fields[][64], int max_fields)` "
    "that splits a CSV line into fields, handling double-quoted fields with embedded commas. "
    "Include a small main() that tests it.",
    "Write a Python function that reads a log file, counts the requests per HTTP status code and "
    "per hour, and prints both tables sorted. Include type hints and docstrings.",
    "Complete this JavaScript:\n\n"
    "```javascript\n"
    "// Debounce: call fn only after `wait` ms have passed without another call.\n"
    "function debounce(fn, wait) {\n"
    "```\n\n"
    "Then write a throttle function in the same style, and unit tests for both using Jest.",
    "Write a SQL schema for a library system with tables for books, authors, members and loans, "
    "with primary keys, foreign keys and indexes, then write five example queries.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Implement binary search in Rust, both iteratively and recursively, with tests.",
    "Complete the following Go program:\n\n"
    "```go\n"
    "package main\n\n"
    "import (\n"
    "    \"fmt\"\n"
    "    \"sort\"\n"
    ")\n\n"
    "type Employee struct {\n"
    "    Name   string\n"
    "    Dept   string\n"
    "    Salary int\n"
    "}\n\n"
    "// groupByDept returns the employees of each department sorted by salary, highest first.\n"
    "func groupByDept(emps []Employee) map[string][]Employee {\n"
    "```",
    "Write a bash script that backs up a directory to a timestamped tar.gz archive, keeps only the "
    "last seven backups, and logs what it did.",
    "Write a Python class `Matrix` with addition, multiplication, transpose and a determinant "
    "method for square matrices, plus `__repr__` and `__eq__`.",
    "Write a small Flask application with routes to create, list, update and delete to-do items "
    "stored in SQLite.",
    "Write a TypeScript interface for a blog post with comments, and functions to add a comment, "
    "edit a comment and count the comments by author.",
]

_PASSAGE_HISTORY = (
    "The town of Marrowfield grew up around a ford on the river Kell, where drovers once brought "
    "cattle down from the hill farms to the autumn markets. For almost two centuries the ford was "
    "the only crossing for twenty miles, and the inns, smithies and chandlers that served the "
    "drovers became the first streets of the town. In 1786 a stone bridge of five arches replaced "
    "the ford. It was paid for by a toll, collected from a small octagonal house at the north end "
    "that still stands today. The bridge brought wheeled traffic, and with it a weekly corn market, "
    "a bank and, in 1841, the first newspaper, the Marrowfield Courier. The railway arrived in "
    "1859, but it kept to the far side of the valley, and the station was built a mile from the "
    "market square. A horse tram ran between the two until 1911. The mills that followed the "
    "railway made woollen cloth and, later, carpets; at their peak in the 1890s they employed "
    "nearly three thousand people. The last mill closed in 1978. Its buildings now hold a museum, "
    "a brewery, artists' studios and eighty flats, and the mill race has been restored to drive a "
    "small turbine that supplies part of the town's electricity."
)

_PASSAGE_NOTICE = (
    "Notice to residents: water supply interruption. Between 08:00 on Tuesday 14 May and 18:00 on "
    "Wednesday 15 May, the water supply to Alder Road, Birch Close, Cedar Avenue and the even "
    "numbers of Station Road will be interrupted while the main under Cedar Avenue is replaced. "
    "The work is part of a programme to replace cast-iron mains laid before 1950, which are the "
    "cause of most bursts in the area. During the interruption a water bowser will be parked at the "
    "junction of Alder Road and Station Road; please bring your own containers. Residents who are "
    "registered as priority customers, for example because they use dialysis equipment at home or "
    "care for a young baby, will receive bottled water delivered to their door on both days. If "
    "you are not registered but need this help, call the customer line on 0800 555 0199 before "
    "Friday 10 May. When the supply is restored the water may look cloudy or discoloured for a "
    "short time. This is caused by air and sediment disturbed by the work and is not harmful: run "
    "the cold kitchen tap until the water is clear. Do not run the hot taps or use washing "
    "machines until the cold water is clear. We apologise for the inconvenience and thank you for "
    "your patience."
)

_CODE_BLOCK = (
    "```python\n"
    "def load_users(path):\n"
    "    users = []\n"
    "    f = open(path)\n"
    "    for line in f.readlines():\n"
    "        parts = line.strip().split(',')\n"
    "        if len(parts) < 3:\n"
    "            continue\n"
    "        user = {}\n"
    "        user['name'] = parts[0]\n"
    "        user['email'] = parts[1]\n"
    "        user['age'] = int(parts[2])\n"
    "        if user['age'] >= 18:\n"
    "            user['adult'] = True\n"
    "        else:\n"
    "            user['adult'] = False\n"
    "        users.append(user)\n"
    "    f.close()\n"
    "    return users\n\n\n"
    "def average_age(users):\n"
    "    total = 0\n"
    "    count = 0\n"
    "    for user in users:\n"
    "        total = total + user['age']\n"
    "        count = count + 1\n"
    "    if count == 0:\n"
    "        return 0\n"
    "    return total / count\n\n\n"
    "def adults(users):\n"
    "    result = []\n"
    "    for user in users:\n"
    "        if user['adult'] == True:\n"
    "            result.append(user)\n"
    "    return result\n"
    "```"
)

_PASSAGE_RECIPE = (
    "Brown bread, makes one large loaf. Ingredients: 500 g wholemeal flour, 10 g salt, 7 g dried "
    "yeast, 350 ml warm water, 1 tablespoon honey, 2 tablespoons olive oil, a handful of mixed "
    "seeds. Method: Mix the flour, salt and yeast in a large bowl, keeping the salt and the yeast "
    "on opposite sides of the bowl at first. Stir the honey and the oil into the warm water, pour "
    "it into the flour and mix with one hand until a rough, sticky dough forms. Turn the dough out "
    "onto a lightly oiled surface and knead it for ten minutes, until it is smooth and springs back "
    "when pressed. Put it back in the bowl, cover it with a damp cloth and leave it somewhere warm "
    "for about an hour, until it has doubled in size. Knock the air out of the dough, knead in the "
    "seeds, shape it into an oval and put it into an oiled loaf tin. Cover it again and leave it "
    "to rise for another forty minutes. Heat the oven to 220 degrees. Brush the top of the loaf "
    "with water, scatter a few more seeds on it and bake for thirty to thirty-five minutes, until "
    "it is dark brown and sounds hollow when tapped underneath. Cool it on a wire rack for at "
    "least half an hour before slicing."
)

_GROUNDED = [
    "Repeat the following passage exactly, word for word, then add one sentence at the end "
    f"saying what it is about.\n\n{_PASSAGE_HISTORY}",
    "Rewrite the following notice so that every sentence is in plain English, keeping all the "
    "dates, times, street names and the phone number exactly as they are. Keep the same order."
    f"\n\n{_PASSAGE_NOTICE}",
    "Refactor the following Python code: use a with-statement to open the file, use the csv "
    "module, add type hints and docstrings, and simplify the boolean logic. Keep the function "
    f"names and behaviour the same and output the complete new code.\n\n{_CODE_BLOCK}",
    "Convert the following recipe into a numbered list of steps, keeping the original wording of "
    "each step as far as possible, preceded by a bulleted ingredient list with the same quantities."
    f"\n\n{_PASSAGE_RECIPE}",
    "Summarise the following passage in about 100 words, reusing its own phrases and all of its "
    f"dates and numbers.\n\n{_PASSAGE_HISTORY}",
    "Turn the following notice into a short list of questions and answers a resident might ask, "
    f"quoting the notice's own words in each answer.\n\n{_PASSAGE_NOTICE}",
    "Add a docstring to every function in the following code, saying what it takes, what it "
    "returns and what happens on bad input, and output the complete code with nothing else "
    f"changed: same names, same statements, same order.\n\n{_CODE_BLOCK}",
    "Repeat the following recipe exactly, but change every metric quantity to its imperial "
    f"equivalent in brackets after it.\n\n{_PASSAGE_RECIPE}",
    "Extract every year mentioned in the following passage and, for each, quote the sentence it "
    f"appears in.\n\n{_PASSAGE_HISTORY}",
    "Translate the following notice into French, keeping all names, dates, times and the phone "
    f"number unchanged.\n\n{_PASSAGE_NOTICE}",
    "Write unit tests with pytest for every function in the following code, covering an empty "
    "file, a short line and a minor, then repeat the code itself unchanged so the tests and the "
    f"code can be saved together.\n\n{_CODE_BLOCK}",
    "Correct any spelling or grammar mistakes in the following passage and output it in full; if "
    f"there are none, output it unchanged.\n\n{_PASSAGE_RECIPE}",
]


# code edits: a source file in the prompt and a change asked of it, the whole file back. The answer
# quotes the file (prompt lookup's part), writes the new code where the change goes (a model's
# part), and quotes again: the mix a cascade of n-gram and a draft model is for. The changes sit
# near the top or in the middle of each file, so both kinds of text come early in the answer.
_EDIT_INVENTORY = (
    "```python\n"
    "class Inventory:\n"
    "    def __init__(self):\n"
    "        self.items = {}\n\n"
    "    def add_item(self, name, quantity, price):\n"
    "        if name in self.items:\n"
    "            self.items[name]['quantity'] += quantity\n"
    "        else:\n"
    "            self.items[name] = {'quantity': quantity, 'price': price}\n\n"
    "    def remove_item(self, name, quantity):\n"
    "        if name not in self.items:\n"
    "            return False\n"
    "        if self.items[name]['quantity'] < quantity:\n"
    "            return False\n"
    "        self.items[name]['quantity'] -= quantity\n"
    "        if self.items[name]['quantity'] == 0:\n"
    "            del self.items[name]\n"
    "        return True\n\n"
    "    def total_value(self):\n"
    "        total = 0\n"
    "        for name in self.items:\n"
    "            total += self.items[name]['quantity'] * self.items[name]['price']\n"
    "        return total\n\n"
    "    def low_stock(self, threshold):\n"
    "        result = []\n"
    "        for name in self.items:\n"
    "            if self.items[name]['quantity'] < threshold:\n"
    "                result.append(name)\n"
    "        return result\n"
    "```"
)

_EDIT_TODO = (
    "```javascript\n"
    "class TodoStore {\n"
    "  constructor() {\n"
    "    this.todos = [];\n"
    "    this.nextId = 1;\n"
    "  }\n\n"
    "  add(title) {\n"
    "    const todo = { id: this.nextId, title: title, done: false };\n"
    "    this.nextId += 1;\n"
    "    this.todos.push(todo);\n"
    "    return todo;\n"
    "  }\n\n"
    "  complete(id) {\n"
    "    const todo = this.todos.find((t) => t.id === id);\n"
    "    if (!todo) {\n"
    "      return false;\n"
    "    }\n"
    "    todo.done = true;\n"
    "    return true;\n"
    "  }\n\n"
    "  remove(id) {\n"
    "    const before = this.todos.length;\n"
    "    this.todos = this.todos.filter((t) => t.id !== id);\n"
    "    return this.todos.length < before;\n"
    "  }\n\n"
    "  pending() {\n"
    "    return this.todos.filter((t) => !t.done);\n"
    "  }\n"
    "}\n\n"
    "module.exports = { TodoStore };\n"
    "```"
)

_EDIT_CONFIG = (
    "```go\n"
    "package config\n\n"
    "import (\n"
    "    \"bufio\"\n"
    "    \"os\"\n"
    "    \"strings\"\n"
    ")\n\n"
    "type Config struct {\n"
    "    values map[string]string\n"
    "}\n\n"
    "func Load(path string) (*Config, error) {\n"
    "    f, err := os.Open(path)\n"
    "    if err != nil {\n"
    "        return nil, err\n"
    "    }\n"
    "    defer f.Close()\n"
    "    cfg := &Config{values: map[string]string{}}\n"
    "    scanner := bufio.NewScanner(f)\n"
    "    for scanner.Scan() {\n"
    "        line := strings.TrimSpace(scanner.Text())\n"
    "        if line == \"\" || strings.HasPrefix(line, \"#\") {\n"
    "            continue\n"
    "        }\n"
    "        parts := strings.SplitN(line, \"=\", 2)\n"
    "        if len(parts) != 2 {\n"
    "            continue\n"
    "        }\n"
    "        cfg.values[strings.TrimSpace(parts[0])] = strings.TrimSpace(parts[1])\n"
    "    }\n"
    "    return cfg, scanner.Err()\n"
    "}\n\n"
    "func (c *Config) Get(key string, fallback string) string {\n"
    "    if v, ok := c.values[key]; ok {\n"
    "        return v\n"
    "    }\n"
    "    return fallback\n"
    "}\n"
    "```"
)

_WHOLE = " Output the complete new file and nothing else."
_CODE_EDIT = [
    "Add a method `update_price(self, name, price)` right after `add_item` in the following "
    "class; it returns False if the item is unknown or the price is negative." + _WHOLE
    + f"\n\n{_EDIT_INVENTORY}",
    "In the following class, make `add_item` raise ValueError when the quantity or the price is "
    "negative, and make `remove_item` raise KeyError for an unknown item instead of returning "
    "False." + _WHOLE + f"\n\n{_EDIT_INVENTORY}",
    "Add a `__len__` method and a `from_dict(cls, data)` classmethod right after `__init__` in "
    "the following class, and a `most_valuable(self)` method at the end." + _WHOLE
    + f"\n\n{_EDIT_INVENTORY}",
    "Add a method `rename(id, title)` right after `add` in the following class; it returns false "
    "when no todo has that id." + _WHOLE + f"\n\n{_EDIT_TODO}",
    "In the following class, give every todo a `createdAt` date in `add`, make `complete` also "
    "record a `completedAt` date, and add a `completed()` method after `pending()`." + _WHOLE
    + f"\n\n{_EDIT_TODO}",
    "Make the constructor of the following class take an optional array of titles to add at "
    "once, and add a `clearCompleted()` method right after `remove`." + _WHOLE
    + f"\n\n{_EDIT_TODO}",
    "Add a method `GetInt(key string, fallback int) int` right after `Load` in the following Go "
    "file, using strconv.Atoi and returning the fallback on an error." + _WHOLE
    + f"\n\n{_EDIT_CONFIG}",
    "Change `Load` in the following Go file so that a line without '=' returns an error naming "
    "the line number, instead of being skipped." + _WHOLE + f"\n\n{_EDIT_CONFIG}",
    "Add a `Set(key, value string)` method and a `Keys() []string` method returning the keys in "
    "sorted order, both right after the Config type in the following Go file." + _WHOLE
    + f"\n\n{_EDIT_CONFIG}",
    "Rewrite the following code so that `load_users` skips lines whose age is not a number, "
    "logging a warning for each with the logging module." + _WHOLE + f"\n\n{_CODE_BLOCK}",
    "Add a function `find_by_email(users, email)` right after `load_users` in the following code; "
    "it returns the first matching user or None." + _WHOLE + f"\n\n{_CODE_BLOCK}",
    "Rewrite the following code with `average_age` returning None for an empty list and a new "
    "function `oldest(users)` placed between `average_age` and `adults`." + _WHOLE
    + f"\n\n{_CODE_BLOCK}",
]


# an agent loop: one system instruction, then requests that each want a structured answer about a
# different input. What repeats is across requests (the JSON shape, the tool names, the argument
# keys), not within one: the source the suffix speculator reads and per-sequence n-gram cannot.
_AGENT_SYSTEM = (
    "You are the tool router of an assistant. Reply with exactly one JSON object of the form "
    '{"tool": NAME, "arguments": {...}} and nothing else. Tools: get_weather(city, unit), '
    "search_flights(origin, destination, date, passengers), create_event(title, date, time, "
    "attendees), send_email(to, subject, body), convert_currency(amount, from_currency, "
    "to_currency).\n\nRequest: "
)
_AGENT = [_AGENT_SYSTEM + r for r in (
    "What is the weather like in Lisbon today, in celsius?",
    "Find me flights from Boston to Denver on 2027-03-14 for two people.",
    "Put a meeting called Budget review on 2027-01-20 at 10:00 with Ana and Joao.",
    "Email maria@example.com that the report is late, subject Report delay.",
    "How much is 250 US dollars in euros?",
    "Is it going to be cold in Oslo? Use fahrenheit.",
    "I need a flight from Madrid to Rome on 2027-05-02, just me.",
    "Schedule Team lunch on 2027-02-03 at 12:30 with Priya, Tom and Lee.",
    "Send an email to ops@example.com with subject Disk full saying the backup server is out of space.",
    "Convert 1200 Japanese yen to British pounds.",
    "What's the weather in Nairobi right now in celsius?",
    "Book-search flights Chicago to Seattle on 2027-04-09 for three passengers.",
)]


def _workload(name: str, texts: list[str]) -> Workload:
    return Workload(name, [Prompt(f"{name}-{i + 1}", t) for i, t in enumerate(texts)])


WORKLOADS: dict[str, Workload] = {
    "prose": _workload("prose", _PROSE),
    "factual": _workload("factual", _FACTUAL),
    "code": _workload("code", _CODE),
    "grounded": _workload("grounded", _GROUNDED),
}


# built in, but run only when named (``-w agent``): its requests are meant to run in order through
# one engine, and its point is what a speculator carries from one request to the next
EXTRA_WORKLOADS: dict[str, Workload] = {
    "agent": _workload("agent", _AGENT),
    "code-edit": _workload("code-edit", _CODE_EDIT),
}


def workload_names() -> list[str]:
    """The workloads a bench runs when none is named."""
    return list(WORKLOADS)


def known_workloads() -> list[str]:
    """Every built-in workload name, the ones run only when named included."""
    return [*WORKLOADS, *EXTRA_WORKLOADS]


def get_workload(name: str) -> Workload:
    """A built-in workload by name (``BadInput`` listing the known names otherwise)."""
    key = name.strip().lower()
    found = WORKLOADS.get(key) or EXTRA_WORKLOADS.get(key)
    if found is None:
        raise BadInput(f"unknown workload {name!r} (known: {', '.join(known_workloads())})")
    return found


# ----------------------------------------------------------------------------- user prompts


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file (``{"id", "text"}`` per line) or a blank-line-separated text file.

    Ids default to ``<file stem>-<n>`` (1-based); they must be unique.
    """
    p = Path(path)
    content = read_user_file(p, "prompts file")  # a BOM is no prompt text (nor valid JSON)
    prompts = _parse_jsonl(content, p) if p.suffix.lower() == ".jsonl" else _parse_text(content, p)
    if not prompts:
        raise BadInput(f"prompts file {str(p)!r}: no prompts")
    seen: set[str] = set()
    for pr in prompts:
        if pr.id in seen:
            raise BadInput(f"prompts file {str(p)!r}: duplicate prompt id {pr.id!r}")
        seen.add(pr.id)
    return prompts


def load_workload(path: str | Path, name: str | None = None) -> Workload:
    """A user workload from a prompts file, named after the file stem unless ``name`` is given."""
    p = Path(path)
    return Workload(name or p.stem, load_prompts(p))


def _parse_text(content: str, p: Path) -> list[Prompt]:
    blocks: list[list[str]] = [[]]
    for line in content.replace("\r\n", "\n").split("\n"):
        if line.strip():
            blocks[-1].append(line.rstrip())
        elif blocks[-1]:
            blocks.append([])
    texts = ["\n".join(b) for b in blocks if b]
    return [Prompt(f"{p.stem}-{i + 1}", t) for i, t in enumerate(texts)]


def _parse_jsonl(content: str, p: Path) -> list[Prompt]:
    prompts: list[Prompt] = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"prompts file {str(p)!r} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{where}: invalid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise BadInput(f'{where}: expected an object with "text"')
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadInput(f'{where}: missing or empty "text"')
        pid = obj.get("id", f"{p.stem}-{len(prompts) + 1}")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool) or not str(pid).strip():
            raise BadInput(f'{where}: "id" must be a non-empty string or integer')
        prompts.append(Prompt(str(pid), text))
    return prompts
