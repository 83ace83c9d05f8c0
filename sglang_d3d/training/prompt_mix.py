"""A broad, self-assembled mix of instruction and code prompts for distillation data.

GSM8K alone would teach the drafter one register (step-by-step arithmetic). Open-ended chat
(writing, explanations, code, lists, rewriting) needs its own data, but the public chat sets we
evaluate on (MT-Bench) must stay out of training, so the mix is built here from templates and
topic lists written for this project. Every prompt is distinct; the order is deterministic.
"""

from __future__ import annotations

import itertools
import random

CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the vowels in a string",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the order",
    "finds the largest element in a list without using max()",
    "checks whether a string is a palindrome",
    "computes the factorial of a number recursively",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the most common word in a text",
    "flattens a nested list",
    "computes the greatest common divisor of two integers",
    "sorts a list of dictionaries by a given key",
    "checks whether two strings are anagrams",
    "implements binary search on a sorted list",
    "reads a CSV file and returns the sum of one column",
    "counts how many times each character appears in a string",
    "validates an email address with a regular expression",
    "transposes a matrix given as a list of lists",
    "implements a simple stack class with push, pop and peek",
    "implements a queue using two stacks",
    "returns all prime numbers below n using the sieve of Eratosthenes",
    "converts a Roman numeral to an integer",
    "rotates a list by k positions",
    "finds the second largest number in a list",
    "capitalizes the first letter of every word in a sentence",
    "computes the running average of a stream of numbers",
    "checks whether parentheses in a string are balanced",
    "implements bubble sort",
    "implements merge sort",
    "returns the intersection of two lists",
    "computes the sum of the digits of an integer",
    "converts a decimal number to binary",
    "finds the longest word in a sentence",
    "implements a linked list with insert and delete",
    "counts the lines, words and characters of a text file",
    "returns the median of a list of numbers",
    "generates all permutations of a string",
    "checks whether a year is a leap year",
)
LANGUAGES = ("Python", "JavaScript", "C", "Java", "Go", "Rust")
CODE_TEMPLATES = (
    "Write a {lang} function that {task}.",
    "Write a {lang} function that {task}, and explain how it works.",
    "Show me how to write a program in {lang} that {task}. Include a short example.",
)

CONCEPTS = (
    "photosynthesis", "gravity", "inflation", "machine learning", "the water cycle",
    "supply and demand", "black holes", "the immune system", "blockchain", "climate change",
    "the French Revolution", "compound interest", "DNA replication", "electricity",
    "the internet", "plate tectonics", "vaccines", "recursion in programming", "democracy",
    "the greenhouse effect", "natural selection", "the stock market", "quantum computing",
    "renewable energy", "the Pythagorean theorem", "probability", "the Renaissance",
    "neural networks", "the theory of relativity", "opportunity cost", "osmosis",
    "the scientific method", "cloud computing", "volcanoes", "the Industrial Revolution",
    "hash tables", "sleep and memory", "the placebo effect", "encryption", "ocean tides",
    "antibiotic resistance", "the Roman Empire", "magnetism", "operating systems",
    "the food chain", "exchange rates", "the human heart", "sound waves", "fractions",
    "version control with git",
)
EXPLAIN_TEMPLATES = (
    "Explain {c} in simple terms.",
    "Explain {c} to a ten-year-old.",
    "What are the most important things to know about {c}?",
    "Give a short overview of {c} and why it matters.",
)

TOPICS = (
    "the benefits of regular exercise", "learning a second language", "remote work",
    "the importance of reading", "city life versus country life", "social media",
    "protecting the oceans", "the future of transportation", "healthy eating",
    "the value of friendship", "space exploration", "public libraries", "time management",
    "volunteering", "the role of art in society", "online education", "recycling",
    "the history of the bicycle", "music and mood", "travelling on a budget",
    "artificial intelligence in medicine", "saving money", "the four-day work week",
    "gardening", "the importance of sleep", "electric cars", "team sports",
    "learning to cook", "museums", "smartphones and children",
)
WRITING_TEMPLATES = (
    "Write a short essay about {t}.",
    "Write a persuasive paragraph about {t}.",
    "Write a blog post introduction about {t}.",
    "List five key points about {t}.",
    "Give three arguments for and three against {t}.",
)

LIST_THINGS = (
    "tips for studying effectively", "ways to reduce stress", "healthy breakfast ideas",
    "things to pack for a camping trip", "ways to save energy at home",
    "questions to ask in a job interview", "habits of productive people",
    "ideas for a rainy day", "ways to improve writing skills", "tips for public speaking",
    "easy houseplants for beginners", "ways to be more environmentally friendly",
    "good practices for writing clean code", "tips for a first-time manager",
    "ideas for a birthday party", "ways to stay motivated while learning",
)
LIST_TEMPLATES = ("Give me a list of {n} {x}.", "What are {n} {x}? Explain each briefly.")

SENTENCES = (
    "The meeting has been moved to next Tuesday because the manager is sick.",
    "I think we should buy the cheaper laptop since it does the same things.",
    "Our team finished the project two weeks early and under budget.",
    "The restaurant was crowded, the food was cold and the waiter was rude.",
    "Please remember to turn off the lights when you leave the office.",
    "The new park downtown has a playground, a pond and lots of trees.",
    "She practiced the piano every day for a year before her first concert.",
    "Due to heavy rain, the football match was cancelled.",
    "We are excited to announce the launch of our new mobile app.",
    "He forgot his keys at home, so he had to wait outside for an hour.",
)
REWRITE_TEMPLATES = (
    "Rewrite the following sentence to sound more formal: {s}",
    "Rewrite the following sentence in a friendly, casual tone: {s}",
    "Summarize the following sentence in at most eight words: {s}",
    "Translate the following sentence into French: {s}",
    "Correct any grammar mistakes and improve the style: {s}",
)

MESSAGES = (
    ("an email to a colleague", "asking for help with a report"),
    ("an email to a landlord", "reporting a broken heater"),
    ("a thank-you note to a teacher", "at the end of the school year"),
    ("a cover letter", "for a junior software developer position"),
    ("a short speech", "for a friend's wedding"),
    ("a product description", "for a reusable water bottle"),
    ("a text message to a friend", "cancelling dinner plans politely"),
    ("an announcement", "about a new office recycling program"),
    ("a short story opening", "about a robot who wants to paint"),
    ("a poem", "about autumn in the city"),
    ("a restaurant review", "for a small Italian place"),
    ("a complaint letter", "about a delayed package"),
)
MESSAGE_TEMPLATES = ("Write {kind} {about}.", "Draft {kind} {about}. Keep it under 150 words.")

REASONING = (
    "If all roses are flowers and some flowers fade quickly, can we conclude that some roses "
    "fade quickly? Explain.",
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much "
    "does the ball cost? Explain your reasoning.",
    "What is the next number in the sequence 2, 6, 12, 20, 30? Explain the pattern.",
    "Three friends split a bill of $84 equally and each adds a $3 tip. How much does each pay?",
    "A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What is its average speed?",
    "Is it possible for a week to have two Fridays the 13th in the same month? Explain.",
    "Which is heavier: a kilogram of feathers or a kilogram of iron? Explain.",
    "A rectangle has a perimeter of 30 cm and a length of 9 cm. What is its area?",
    "Solve for x: 3x + 7 = 25. Show each step.",
    "What is 15% of 240? Show how you calculate it.",
    "A shop sells pens at 3 for $2. How much do 12 pens cost?",
    "Convert 2.5 hours into minutes and seconds.",
    "Solve the system of equations x + y = 10 and x - y = 4.",
    "What is the probability of rolling a sum of 7 with two fair dice?",
    "A recipe needs 3 cups of flour for 12 cookies. How much flour is needed for 30 cookies?",
    "Find the derivative of f(x) = 3x^2 + 2x - 5 and explain the rule you used.",
)

QA = (
    "What is the difference between a list and a tuple in Python?",
    "How does a hash map handle collisions?",
    "What is the difference between TCP and UDP?",
    "Why is the sky blue?",
    "How do airplanes stay in the air?",
    "What causes the seasons on Earth?",
    "What is the difference between weather and climate?",
    "How does a refrigerator keep food cold?",
    "What are the main causes of World War I?",
    "What is the difference between a virus and a bacterium?",
    "How do I make a good first impression at a new job?",
    "What should I consider when choosing a laptop?",
    "How can I improve my credit score?",
    "What is the difference between SQL and NoSQL databases?",
    "What does a compiler do?",
    "How do vaccines train the immune system?",
    "What is the role of the mitochondria in a cell?",
    "How do I start learning to program?",
    "What are the pros and cons of nuclear energy?",
    "How does GPS work?",
    "What is Big O notation?",
    "What is the difference between RAM and storage?",
    "How does a bill become a law in the United States?",
    "What is the difference between an acid and a base?",
)


def _code() -> list[str]:
    return [t.format(lang=lang, task=task) for t, lang, task in
            itertools.product(CODE_TEMPLATES, LANGUAGES, CODE_TASKS)]


def _prose() -> list[str]:
    out = [t.format(c=c) for t, c in itertools.product(EXPLAIN_TEMPLATES, CONCEPTS)]
    out += [t.format(t=x) for t, x in itertools.product(WRITING_TEMPLATES, TOPICS)]
    out += [t.format(n=n, x=x) for t, n, x in itertools.product(LIST_TEMPLATES, (3, 5), LIST_THINGS)]
    out += [t.format(s=s) for t, s in itertools.product(REWRITE_TEMPLATES, SENTENCES)]
    out += [t.format(kind=k, about=a) for t, (k, a) in itertools.product(MESSAGE_TEMPLATES, MESSAGES)]
    return out + list(REASONING) + list(QA)


def build_mix(seed: int = 0, max_code: int = 360) -> list[str]:
    """All mix prompts, distinct, in a seeded shuffled order.

    Code combinations are plentiful (720) and repetitive, so only `max_code` of them are kept to
    leave room for prose in any prefix of the list.
    """
    rng = random.Random(seed)
    code = _code()
    rng.shuffle(code)
    prompts = list(dict.fromkeys(code[:max_code] + _prose()))
    rng.shuffle(prompts)
    return prompts
