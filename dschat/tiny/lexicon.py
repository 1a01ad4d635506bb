"""Word lists shared by the data generator and the rule scorer.

They live in one module so the scorer judges answers against exactly the facts the data was built from.
Everything is a tuple or a dict built from tuples: ordered, so generation does not depend on set order
(string hashing changes between processes).
"""

# The lists are small on purpose: every fact (a category member, an opposite, a sum) recurs many times in
# each step's share of the data, so a tiny model trained for a minute or two can learn it by rote.

# Category name, as used in "List three colors." -> its members.
CATEGORIES = {
    "colors": ("red", "blue", "green", "yellow", "black", "white"),
    "fruits": ("apple", "banana", "grape", "pear", "lemon", "mango"),
    "animals": ("cat", "dog", "horse", "cow", "lion", "duck"),
    "drinks": ("water", "milk", "tea", "coffee", "juice", "soda"),
}

# Number words the prompts use for small counts; the scorer also accepts digits.
COUNT_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "once": 1, "twice": 2}
NUMBER_NAMES = {2: "two", 3: "three", 4: "four"}

# Each word has exactly one opposite, in both directions, so the scorer can check an answer by lookup.
ANTONYM_PAIRS = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("open", "closed"), ("old", "new"), ("wet", "dry"), ("full", "empty"),
    ("day", "night"), ("good", "bad"),
)
OPPOSITES = {}
for _a, _b in ANTONYM_PAIRS:
    OPPOSITES[_a] = _b
    OPPOSITES[_b] = _a
assert len(OPPOSITES) == 2 * len(ANTONYM_PAIRS), "every word must have a single opposite"

# Words the end-of-reply task asks for as the final word.
END_WORDS = ("done", "okay", "thanks", "bye", "now")

# Words the repeat task asks to repeat.
REPEAT_WORDS = ("red", "blue", "cat", "dog", "tea", "milk", "hello", "yes", "sun", "moon")

# Building blocks for the short phrases of the uppercase task.
PHRASE_ADJECTIVES = ("small", "big", "red", "happy", "old", "fast", "lazy", "dark")
PHRASE_NOUNS = ("cat", "dog", "bird", "car", "house", "tree", "boat", "child", "book", "cake")
PHRASE_VERBS = ("runs", "sleeps", "sings", "jumps", "swims", "waits")
PHRASE_PLACES = ("at home", "in the park", "at night", "in the rain")
