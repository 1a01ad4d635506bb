"""The tiny rule scorer on hand-written answers, in both prompt forms."""
import pytest

from dschat.tiny.scorer import extract_user_message, parse_instruction, rule_score, score_batch


def formatted(message):
    return f"\n\nHuman: {message}\n\nAssistant:"


@pytest.mark.parametrize("prompt, good, bad", [
    ("List three colors.", "red, blue, green", "red, blue"),
    ("Name 2 fruits.", "apple and pear", "I like apple"),
    ("What is the opposite of hot?", "cold", "hot"),
    ("What is 3 plus 4?", "7", "8"),
    ("Compute 5 minus 2.", "3", "I do not know"),
    ("Say moon three times.", "moon moon moon", "moon moon"),
    ("Copy this: the cat sleeps.", "the cat sleeps", "the dog runs"),
    ("Copy this: the cat sleeps. Use all caps.", "THE CAT SLEEPS", "the cat sleeps"),
    ("Use all caps. List two animals.", "CAT, DOG", "cat, dog"),
    ("Say tea two times. End with the word done.", "tea tea done", "tea tea"),
    ("Make the last word bye. What is 2 + 2?", "4, bye", "bye 4"),
    ("Hi! Answer in capital letters. What is the opposite of up? Finish with the word now.", "DOWN. NOW",
     "down now"),
])
def test_following_the_instruction_scores_higher(prompt, good, bad):
    assert rule_score(prompt, good) == pytest.approx(1.0)
    assert rule_score(prompt, bad) < 0.5


def test_formatted_prompt_reads_the_last_user_message():
    message = "What is the opposite of hot?"
    assert extract_user_message(formatted(message)) == message
    history = f"\n\nHuman: List two colors.\n\nAssistant: red, blue{formatted(message)}"
    assert extract_user_message(history) == message
    assert rule_score(history, " cold") == 1.0
    assert rule_score(formatted(message), " cold") == rule_score(message, "cold")


def test_whitespace_and_end_of_text_tokens_are_ignored():
    prompt = formatted("Say sun two times. Use all caps.")
    assert rule_score(prompt, "  SUN SUN <|endoftext|>") == 1.0
    assert rule_score(prompt, " SUN SUN<|endoftext|><pad><pad>") == 1.0
    # Text after the end of the answer is not part of the answer.
    assert rule_score(prompt, " SUN SUN<|endoftext|>\n\nHuman: hello") == 1.0


def test_partial_credit_is_between_zero_and_one():
    assert rule_score("What is the opposite of hot?", "The opposite of hot is cold.") == 0.5
    assert rule_score("What is 1 plus 1?", "the answer is 2") == 0.5
    assert 0 < rule_score("List four colors.", "red, blue, green") < 0.5
    assert 0 < rule_score("Say cat two times. End with the word okay.", "cat cat") < 0.5
    assert 0 < rule_score("Copy this: the small cat. Use all caps.", "THE SMALL DOG") < 1


def test_caps_does_not_apply_to_a_bare_number():
    assert rule_score("Use all caps. What is 2 plus 2?", "4") == 1.0


def test_unknown_prompts_score_zero():
    assert parse_instruction("Tell me a story.") is None
    assert rule_score("Tell me a story.", "Once upon a time") == 0.0


def test_score_batch_pairs_prompts_with_answers():
    assert score_batch(["What is 1 plus 2?", "What is 1 plus 3?"], ["3", "3"]) == [1.0, 0.0]
    with pytest.raises(ValueError):
        score_batch(["What is 1 plus 2?"], [])
