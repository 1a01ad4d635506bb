"""Word lists shared by the data generator and the rule scorer.

They live in one module so the scorer judges answers against exactly the facts the data was built from.
Everything is a tuple or a dict built from tuples: ordered, so generation does not depend on set order
(string hashing changes between processes).
"""

# Category name (plural, as used in "List three colors.") -> (singular name, members).
CATEGORIES = {
    "colors": ("color", ("red", "blue", "green", "yellow", "black", "white", "orange", "purple",
                         "pink", "brown", "gray")),
    "fruits": ("fruit", ("apple", "banana", "grape", "pear", "peach", "lemon", "mango", "cherry",
                         "plum", "melon", "kiwi", "lime")),
    "animals": ("animal", ("cat", "dog", "horse", "cow", "lion", "tiger", "bear", "wolf", "fox",
                           "rabbit", "mouse", "duck", "goat", "sheep", "pig", "frog")),
    "vegetables": ("vegetable", ("carrot", "potato", "onion", "pea", "bean", "corn", "cabbage",
                                 "lettuce", "spinach", "celery", "radish")),
    "days of the week": ("day of the week", ("monday", "tuesday", "wednesday", "thursday", "friday",
                                             "saturday", "sunday")),
    "shapes": ("shape", ("circle", "square", "triangle", "star", "oval", "diamond", "rectangle",
                         "cube", "cone")),
    "vehicles": ("vehicle", ("car", "bus", "train", "bike", "boat", "plane", "truck", "ship", "van",
                             "taxi")),
    "drinks": ("drink", ("water", "milk", "tea", "coffee", "juice", "soda", "cocoa", "lemonade")),
    "body parts": ("body part", ("hand", "foot", "head", "nose", "ear", "eye", "arm", "leg", "knee",
                                 "mouth")),
}

SINGULAR_TO_PLURAL = {singular: plural for plural, (singular, _) in CATEGORIES.items()}

# Number words the prompts use for small counts; the scorer also accepts digits.
COUNT_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "once": 1, "twice": 2}
NUMBER_NAMES = {2: "two", 3: "three", 4: "four", 5: "five"}

# Each word has exactly one opposite, in both directions, so the scorer can check an answer by lookup.
ANTONYM_PAIRS = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("open", "closed"), ("old", "new"), ("wet", "dry"), ("hard", "soft"),
    ("full", "empty"), ("day", "night"), ("black", "white"), ("rich", "poor"), ("early", "late"),
    ("win", "lose"), ("in", "out"), ("left", "right"), ("top", "bottom"), ("good", "bad"),
    ("strong", "weak"), ("loud", "quiet"), ("thick", "thin"), ("high", "low"), ("clean", "dirty"),
    ("near", "far"), ("push", "pull"), ("buy", "sell"), ("true", "false"), ("yes", "no"),
    ("first", "last"), ("long", "short"), ("alive", "dead"), ("love", "hate"), ("above", "below"),
    ("inside", "outside"), ("give", "take"), ("come", "go"), ("laugh", "cry"), ("question", "answer"),
    ("sweet", "sour"), ("easy", "difficult"), ("safe", "dangerous"), ("boy", "girl"), ("king", "queen"),
    ("north", "south"), ("east", "west"), ("summer", "winter"), ("friend", "enemy"),
    ("always", "never"), ("more", "less"), ("before", "after"), ("front", "back"), ("asleep", "awake"),
    ("wide", "narrow"), ("cheap", "expensive"), ("smooth", "rough"), ("sharp", "dull"),
    ("entrance", "exit"), ("remember", "forget"), ("increase", "decrease"), ("sit", "stand"),
    ("on", "off"), ("rise", "fall"), ("floor", "ceiling"),
)
OPPOSITES = {}
for _a, _b in ANTONYM_PAIRS:
    OPPOSITES[_a] = _b
    OPPOSITES[_b] = _a
assert len(OPPOSITES) == 2 * len(ANTONYM_PAIRS), "every word must have a single opposite"

# Words the end-of-reply task asks for as the final word.
END_WORDS = ("done", "okay", "thanks", "bye", "end", "now", "please", "amen", "finished", "over")

# Words the repeat task asks to repeat: everyday words drawn from the lists above plus a few others.
REPEAT_WORDS = tuple(sorted({w for _, (_, members) in CATEGORIES.items() for w in members[:6]}
                            | {"hello", "yes", "no", "stop", "go", "wow", "ok", "hi", "sun", "moon",
                               "tree", "book", "rain", "snow", "fire", "home", "music", "happy"}))

# Building blocks for the short phrases of the uppercase task.
PHRASE_ADJECTIVES = ("small", "big", "red", "happy", "old", "new", "quiet", "fast", "slow", "warm",
                     "cold", "little", "bright", "dark", "green", "lazy", "brave", "funny", "sleepy",
                     "tall")
PHRASE_NOUNS = ("cat", "dog", "bird", "car", "house", "tree", "boat", "child", "river", "book",
                "garden", "city", "horse", "moon", "song", "door", "cake", "train", "flower", "teacher")
PHRASE_VERBS = ("runs", "sleeps", "sings", "jumps", "waits", "swims", "shines", "falls", "grows",
                "stops", "moves", "smiles")
PHRASE_PLACES = ("at home", "in the park", "by the sea", "at night", "in the rain", "on the hill",
                 "in town", "at school")
