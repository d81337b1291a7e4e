"""The other components of the distillation prompt set (distill/build_prompts.py): subject
lists (split into train / held-out), shared slots and the templates per category."""

from __future__ import annotations

from typing import NamedTuple


class Pair(NamedTuple):
    a: str
    b: str


class MailTask(NamedTuple):
    to: str
    about: str


# ---------------------------------------------------------------------------------------------
# Subject components (split into train / held-out by `split`)
# ---------------------------------------------------------------------------------------------

TOPICS: dict[str, list[str]] = {
    "science": [
        "black holes", "photosynthesis", "plate tectonics", "the water cycle", "DNA replication",
        "quantum entanglement", "the speed of light", "antibiotic resistance", "ocean tides",
        "evolution by natural selection", "the periodic table", "static electricity",
    ],
    "history": [
        "the fall of the Roman Empire", "the Silk Road", "the French Revolution",
        "the ancient Egyptian pyramids", "the Industrial Revolution", "the space race",
        "the Viking Age", "the Ming dynasty", "the invention of writing",
        "the Renaissance in Florence", "the printing revolution",
        "the building of the Panama Canal",
    ],
    "everyday life": [
        "keeping houseplants alive", "doing laundry without shrinking clothes",
        "decluttering a small apartment", "getting along with roommates", "making small talk",
        "organizing a weekly schedule", "morning routines", "recycling at home",
        "choosing a good mattress", "caring for a new puppy", "reducing screen time",
        "hosting a dinner party",
    ],
    "health": [
        "getting enough sleep", "staying hydrated", "stretching before exercise",
        "managing stress", "the benefits of walking", "reading nutrition labels",
        "seasonal allergies", "posture while working at a desk", "strength training for beginners",
        "caffeine and sleep", "the common cold", "sun protection",
    ],
    "travel": [
        "traveling on a tight budget", "packing light", "dealing with jet lag",
        "visiting Japan for the first time", "solo travel", "long train journeys in Europe",
        "camping in national parks", "learning basic phrases before a trip",
        "road trips with kids", "visiting Iceland in winter", "staying safe in a new city",
        "travel insurance",
    ],
    "cooking": [
        "baking sourdough bread", "cooking rice perfectly", "using cast iron pans",
        "making a simple curry", "knife skills", "meal prepping for the week", "cooking with herbs",
        "making fresh pasta", "fermenting vegetables", "grilling vegetables",
        "making a good omelette", "seasoning soups",
    ],
    "money": [
        "building an emergency fund", "compound interest", "credit scores", "index funds",
        "making a monthly budget", "paying off credit card debt", "saving for retirement",
        "renting versus buying a home", "inflation", "negotiating a salary",
        "splitting bills with a partner", "saving for a child's education",
    ],
    "technology": [
        "how Wi-Fi works", "password managers", "cloud storage", "machine learning",
        "how search engines rank pages", "two-factor authentication", "electric car batteries",
        "3D printing", "open-source software", "how GPS works", "backing up a computer",
        "how QR codes work",
    ],
}

TIP_SUBJECTS = [
    "studying for exams", "running a first 5K", "writing a cover letter",
    "sleeping better on hot nights", "learning a new language", "saving money on groceries",
    "staying focused when working from home", "public speaking", "taking better phone photos",
    "keeping a journal", "starting a vegetable garden", "preparing for a job interview",
    "making friends in a new city", "reducing food waste", "staying motivated at the gym",
    "reading more books", "keeping a tidy desk", "negotiating rent",
    "learning to play guitar", "managing email overload",
]

COMPARE_PAIRS = [
    Pair("tea", "coffee"), Pair("cats", "dogs as pets"), Pair("Python", "JavaScript"),
    Pair("electric cars", "hybrid cars"), Pair("running", "swimming for fitness"),
    Pair("e-books", "paper books"), Pair("baking soda", "baking powder"),
    Pair("SSDs", "hard drives"), Pair("yoga", "pilates"),
    Pair("trains", "planes for travel within Europe"),
    Pair("renting a car", "using public transport on vacation"),
    Pair("a laptop", "a desktop computer"), Pair("gas stoves", "induction cooktops"),
    Pair("SQL databases", "NoSQL databases"), Pair("a savings account", "a certificate of deposit"),
    Pair("hostels", "hotels"), Pair("wool", "cotton for hiking clothes"),
    Pair("freelancing", "full-time employment"),
    Pair("bullet journals", "digital to-do apps"), Pair("LED bulbs", "incandescent bulbs"),
]

DEFINITION_TERMS = [
    "opportunity cost", "irony", "an algorithm", "biodiversity", "a metaphor", "entropy",
    "a mortgage", "democracy", "an API", "osmosis", "a placebo", "a recession", "a hypothesis",
    "cognitive dissonance", "a carbon footprint", "latency", "gentrification", "a sonnet",
    "the greenhouse effect", "a dividend", "empathy", "a firewall", "a food desert",
    "impostor syndrome", "a prime number", "supply and demand", "a watershed", "umami",
    "the gig economy", "a tariff", "encryption", "a fiduciary", "an ecosystem", "a paradox",
    "a leap year", "herd immunity", "a blockchain", "a sourdough starter",
    "a lunar eclipse", "a filibuster", "a rain shadow", "a mnemonic",
]

LIST_SUBJECTS = [
    "healthy breakfast ideas", "books every teenager should read", "ways to save energy at home",
    "fun things to do on a rainy day", "famous inventors and what they invented",
    "questions to ask at the end of a job interview", "easy houseplants for beginners",
    "board games for a family night", "ways to make a small bedroom feel bigger",
    "classic movies everyone should see", "cheap date ideas", "good habits for students",
    "vegetables that grow well in containers", "animals that live in the Arctic",
    "ways to reduce stress at work", "podcast topic ideas",
    "team-building activities for remote teams",
    "snacks that are high in protein", "common mistakes new drivers make",
    "things to pack for a beach vacation", "programming languages worth learning",
    "hobbies you can start for under $20", "ways to be more productive in the morning",
    "historical events that changed the world", "birthday party themes for kids",
    "reasons to learn a second language", "foods that are rich in iron",
    "icebreaker questions for a meeting", "outdoor activities for autumn",
    "ways to make a long flight more comfortable",
]

HOWTO_TASKS = [
    "change a flat bicycle tire", "make cold brew coffee at home", "set up a new Wi-Fi router",
    "unclog a bathroom sink without chemicals", "write a simple resume", "plant tomatoes in pots",
    "clean a cast iron skillet", "tie a tie", "make a budget spreadsheet", "jump-start a car",
    "repot a houseplant", "iron a dress shirt", "make a paper airplane that flies far",
    "start a compost bin", "create a strong password you can remember",
    "brew loose-leaf tea properly", "paint a room", "sharpen a kitchen knife",
    "hang a picture frame straight", "make homemade pizza dough", "set up a fish tank",
    "take a screenshot on a laptop", "change the oil in a car", "record a podcast at home",
    "fold a fitted sheet", "learn to juggle three balls", "remove a red wine stain",
    "build a simple birdhouse", "defrost a freezer", "write a thank-you note",
    "do a proper push-up", "plan a week of meals", "set up a home printer", "pitch a tent",
    "make a simple web page with HTML", "descale an electric kettle",
    "knit a basic scarf", "wax a snowboard", "make candles at home", "clean a dishwasher filter",
]

CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "counts how many times each word appears in a text",
    "removes duplicate items from a list while keeping the original order",
    "converts a temperature from Celsius to Fahrenheit",
    "finds the largest number in a list without using a built-in max function",
    "reverses the order of the words in a sentence", "checks whether a year is a leap year",
    "merges two sorted lists into one sorted list",
    "checks that an email address has a basic valid format", "flattens a nested list",
    "groups a list of people by their age",
    "computes the average of a list of numbers, ignoring missing values",
    "capitalizes the first letter of every word in a string",
    "returns the second largest unique number in a list",
    "splits a list into chunks of a given size", "checks whether two strings are anagrams",
    "converts a number of seconds into hours, minutes and seconds",
    "finds the most common character in a string",
    "generates all prime numbers below a given limit", "rotates a list by k positions",
    "parses a date string like 2024-03-15 and returns the day of the week",
    "computes the running total of a list of numbers", "counts the vowels in a string",
    "sorts a list of records by a given key", "returns the intersection of two lists",
    "truncates a string to a maximum length and adds an ellipsis",
    "converts a Roman numeral to an integer",
    "computes the Levenshtein distance between two strings",
    "remembers the results of a slow function so repeated calls are fast",
]

SQL_TASKS = [
    "finds the ten customers who spent the most money, given tables customers(id, name) and "
    "orders(id, customer_id, total)",
    "counts how many orders were placed in each month of 2023, from a table orders(id, created_at)",
    "lists employees who earn more than the average salary of their department, from a table "
    "employees(id, name, department, salary)",
    "finds duplicate email addresses in a users table",
    "returns all products that have never been ordered, given products(id, name) and "
    "order_items(order_id, product_id)",
    "calculates the total revenue per product category",
    "deletes rows older than 90 days from a logs table with a created_at column",
    "finds the second highest salary in an employees table",
    "shows each student's name with their average grade, from students(id, name) and "
    "grades(student_id, grade)",
    "lists the three most recent blog posts for every author",
]

BASH_TASKS = [
    "adds today's date as a prefix to every .txt file in a folder",
    "counts the lines in all Python files in a project",
    "finds the ten largest files in my home directory",
    "checks whether a website is up and prints a warning if it is down",
    "deletes log files older than 30 days",
    "prints the disk usage of each subfolder, sorted by size",
    "prints a message whenever a new file appears in a folder",
    "replaces a word in every Markdown file in a directory",
    "downloads every URL listed in a text file, one per line",
    "converts all PNG images in a folder to JPEG",
]

STORY_CHARACTERS = [
    "a retired lighthouse keeper", "a nervous young dragon", "a robot who works in a bakery",
    "two sisters who haven't spoken in years", "a detective who is afraid of the dark",
    "a cat that can understand people", "a grandmother learning to skateboard",
    "an astronaut on her first mission", "a shy boy who collects rocks", "a street musician",
    "a talking umbrella", "a chef who has lost her sense of taste",
    "a ghost who is bad at scaring people", "a farmer and a lost fox", "a teenage inventor",
    "an old tortoise and a young rabbit", "a mail carrier in a small town",
    "a knight who hates fighting", "a librarian with a secret", "a girl who can talk to trees",
]

STORY_SETTINGS = [
    "in a snowed-in mountain cabin", "on a space station orbiting Mars", "in a busy night market",
    "in a flooded city of the future", "in a seaside village during a storm",
    "inside an enormous library", "on a cross-country train", "in a magical forest",
    "at a school science fair", "in a quiet desert town", "on a pirate ship",
    "in a tiny apartment in Tokyo", "at a county fair", "on the first day of spring",
    "in an abandoned amusement park", "under the sea", "in medieval London",
    "during a city-wide power outage", "at a wedding that goes wrong",
    "on a remote island research station",
]

POEM_SUBJECTS = [
    "the ocean at night", "a city waking up", "autumn leaves", "my grandmother's kitchen",
    "a cup of coffee", "friendship", "the first snow of winter", "a lost umbrella", "the moon",
    "learning to ride a bike", "a busy train station", "an old oak tree", "Monday mornings",
    "a cat asleep in the sun", "rain on a tin roof", "the last day of summer",
    "stars over the desert", "a forgotten letter", "the smell of bread baking",
    "moving to a new home", "a hummingbird at a feeder", "an empty playground at dusk",
    "a kite caught in a tree",
]

MAIL_TASKS = [
    MailTask("my landlord", "about a leaking kitchen faucet that still hasn't been fixed"),
    MailTask("my manager", "asking to work from home two days a week"),
    MailTask("my professor", "asking for an extension on a term paper because I was sick"),
    MailTask("a hotel", "asking whether they can store my luggage after checkout"),
    MailTask("my team", "announcing that the Friday meeting is moving to Thursday"),
    MailTask("a customer", "apologizing for a delayed shipment"),
    MailTask("a neighbor", "about their dog barking late at night"),
    MailTask("a recruiter", "politely declining a job offer"),
    MailTask("my child's teacher", "asking how my son is settling into the new class"),
    MailTask("a former colleague", "asking if they would be a reference for me"),
    MailTask("an online store", "requesting a refund for a blender that arrived broken"),
    MailTask("the city council", "asking for a new crosswalk near the elementary school"),
    MailTask("a friend", "thanking them for helping me move house"),
    MailTask("my gym", "cancelling my membership"),
    MailTask("a client", "following up on an invoice that is three weeks overdue"),
    MailTask("a conference organizer", "proposing a talk about accessible web design"),
    MailTask("my bank", "disputing a card charge I don't recognize"),
    MailTask("my team", "welcoming a new hire named Priya"),
    MailTask("a wedding venue", "asking about availability for next June"),
    MailTask("a plumber", "asking for a quote to replace a water heater"),
    MailTask("my coworkers", "inviting them to a farewell lunch for Sam"),
    MailTask("a supplier", "asking for a small discount on a bulk order"),
    MailTask("my landlord", "giving notice that I will move out at the end of next month"),
    MailTask("a local newspaper", "suggesting a story about our community garden"),
    MailTask("a volunteer group", "thanking them for organizing a beach cleanup"),
    MailTask("an airline", "asking about a suitcase that didn't arrive with my flight"),
    MailTask("a hiring manager", "following up after my job interview last week"),
    MailTask("a doctor's office", "rescheduling my appointment next Tuesday"),
    MailTask("my book club", "suggesting we meet at the new café on Main Street"),
    MailTask("a museum", "asking about group tour prices for a school trip"),
]

MATH_NAMES = [
    "Maya", "Leo", "Aisha", "Tom", "Priya", "Carlos", "Hana", "Sam", "Olivia", "Kwame", "Sofia",
    "Ben", "Mei", "Lucas", "Fatima", "Jonas",
]

# Short passages (60-150 words, written for this file) for rewriting and summarizing.

# ---------------------------------------------------------------------------------------------
# Shared, non-subject slots (not split: they carry no topic)
# ---------------------------------------------------------------------------------------------

LANGS = ["Python", "JavaScript"]
TONES = ["polite", "friendly", "formal", "firm but polite", "warm"]
POEM_FORMS = [
    "a haiku", "a limerick", "a short rhyming poem", "a free-verse poem", "a sonnet",
    "a four-line poem", "a poem for children", "a poem with three short stanzas",
]
COUNTS = ["3", "5", "7", "10"]

# ---------------------------------------------------------------------------------------------
# Templates per category. The last 10% of each list is used only for held-out prompts.
# ---------------------------------------------------------------------------------------------

TEMPLATES: dict[str, list[str]] = {
    "chat": [
        "Can you tell me about {topic}?",
        "What's the most interesting thing about {topic}?",
        "I'm curious about {topic}. Where should a beginner start?",
        "What are some common myths about {topic}?",
        "How would you describe {topic} to someone who has never heard of it?",
        "Quick question: what should everyone know about {topic}?",
        "My friend and I were arguing about {topic} last night. What are the basic facts?",
        "Tell me something surprising about {topic}.",
        "Why do people care so much about {topic}?",
        "If you only had one minute to teach me about {topic}, what would you say?",
    ],
    "instruction": [
        "Explain {topic} in simple terms.",
        "Explain {topic} as if I were twelve years old.",
        "Please explain the basics of {topic} in three short paragraphs.",
        "Explain {topic} using an everyday analogy.",
        "Give me some practical tips for {tip}.",
        "What are your best tips for {tip}? I'm a complete beginner.",
        "I could use some advice on {tip}. What should I keep in mind?",
        "Give me five quick tips for {tip}, one line each.",
        "What are the main differences between {pair.a} and {pair.b}?",
        "Compare {pair.a} and {pair.b} in a short table.",
        "Can you compare {pair.a} and {pair.b} and tell me when each one makes sense?",
        "Give me the pros and cons of {pair.a} versus {pair.b}, then a one-line recommendation.",
    ],
    "code_write": [
        "Write a {lang} function that {task}.",
        "Can you write {lang} code that {task}? Please include a short usage example.",
        "I need a {lang} function that {task}. Add comments explaining each step.",
        "Show me how to write a function in {lang} that {task}.",
        "Write a {lang} function that {task}, and include a couple of test cases.",
        "Write a SQL query that {sql_task}.",
        "How would I write a SQL query that {sql_task}?",
        "Give me a SQL query that {sql_task}, and explain how it works.",
        "Write a bash script that {bash_task}.",
        "Can you give me a short bash command that {bash_task}?",
        "Write a {lang} function that {task}. Then explain its time complexity.",
    ],
    "code_read": [
        "What does this code do?\n\n{snippet.block}",
        "Can you explain this {snippet.lang} code line by line?\n\n{snippet.block}",
        "{snippet.block}\n\nExplain what this snippet does in plain English.",
        "I found this in our codebase and I don't understand it. What is it for?\n\n"
        "{snippet.block}",
        "Explain the following {snippet.lang} code to a beginner:\n\n{snippet.block}",
        "Is there anything that could go wrong with this code?\n\n{snippet.block}",
        "This {bug.lang} code is supposed to {bug.purpose}, but it doesn't work correctly. "
        "Can you find and fix the bug?\n\n{bug.block}",
        "Why doesn't this work? It should {bug.purpose}.\n\n{bug.block}",
        "{bug.block}\n\nThis is meant to {bug.purpose}. What's wrong with it, and how do I fix it?",
        "Please debug this. The goal is to {bug.purpose}.\n\n{bug.block}",
        "Fix the bug in this code (it should {bug.purpose}) and explain what was wrong:\n\n"
        "{bug.block}",
        "Review this code as if it were a pull request. It is supposed to {snippet.purpose}.\n\n"
        "{snippet.block}",
    ],
    "rewrite": [
        "Rewrite this in a more formal tone:\n\n{passage}",
        "Can you simplify this so a ten-year-old could understand it?\n\n{passage}",
        "Fix the grammar and spelling in the following text, keeping the meaning the same.\n\n"
        "{passage}",
        "Turn this into a bulleted list of key points:\n\n{passage}",
        "Shorten this to about half its length without losing the key information.\n\n{passage}",
        "Make this sound friendlier and more casual:\n\n{passage}",
        "Rewrite the following paragraph in plain English.\n\n{passage}",
        "Please proofread this:\n\n{passage}",
        "Cut this down to two sentences:\n\n{passage}",
        "Rewrite this as a short, upbeat social media post:\n\n{passage}",
    ],
    "summarize": [
        "Summarize this in one sentence:\n\n{passage}",
        "Can you give me a short summary of the following?\n\n{passage}",
        "{passage}\n\nWhat is the main point of the text above?",
        "TL;DR this for me please:\n\n{passage}",
        "Summarize the following passage in three bullet points.\n\n\"{passage}\"",
        "Here's a paragraph from something I'm reading. Summarize it for a busy reader.\n\n"
        "{passage}",
        "Read this and tell me the key takeaway:\n\n{passage}",
        "Summarize this text in two sentences, then name one question it leaves open.\n\n"
        "{passage}",
    ],
    "list": [
        "List {n} {things}.",
        "Give me a list of {n} {things}.",
        "What are {n} {things}? Just a quick list.",
        "Can you list {n} {things}, with one sentence about each?",
        "Make a numbered list of {n} {things}.",
        "I need {n} {things}. Keep each one short.",
        "List {n} {things}, ranked from best to worst, and explain the top one.",
    ],
    "story": [
        "Write a short story about {character} {setting}.",
        "Tell me a bedtime story about {character} {setting}. Keep it gentle.",
        "Write a 200-word story featuring {character} {setting}, with a twist at the end.",
        "Can you write a funny short story about {character} {setting}?",
        "Write the opening paragraph of a mystery novel starring {character} {setting}.",
        "Write a very short story (under 100 words) about {character} {setting}.",
        "I need a story for my kids about {character} {setting}. Make it about friendship.",
        "Write a short first-person story told by {character} {setting}.",
        "Write a story about {character} {setting}, told entirely through diary entries.",
    ],
    "poem": [
        "Write {form} about {subject}.",
        "Could you write {form} about {subject}?",
        "I'd love {form} about {subject} to put in a card.",
        "Write {form} about {subject}, with a hopeful ending.",
        "Compose {form} about {subject} in a gentle, melancholy tone.",
        "Write {form} about {subject} that a child could read aloud.",
        "Write {form} about {subject}, then explain the imagery you chose.",
    ],
    "email": [
        "Write an email to {mail.to} {mail.about}.",
        "Can you draft a {tone} email to {mail.to} {mail.about}?",
        "Help me write a short, {tone} message to {mail.to} {mail.about}.",
        "I need to email {mail.to} {mail.about}. Can you write it for me? Keep it under 150 words.",
        "Draft a {tone} letter to {mail.to} {mail.about}.",
        "Write a {tone} email to {mail.to} {mail.about}. Include a clear subject line.",
        "Write two versions of an email to {mail.to} {mail.about}: one {tone} and one very brief.",
    ],
    "definition": [
        "What is {term}?",
        "Define {term} in one sentence.",
        "What does {term} mean? Give an example.",
        "Can you explain what {term} is in simple words?",
        "What's the definition of {term}, and where does the word come from?",
        "Give me a short definition of {term} that I could use in a school essay.",
        "I keep hearing about {term}. What is it exactly?",
        "Define {term} for a five-year-old, then for a university student.",
    ],
    "howto": [
        "How do I {howto}? Please give step-by-step instructions.",
        "Walk me through how to {howto}.",
        "What are the steps to {howto}?",
        "Give me a step-by-step guide to {howto}, for a total beginner.",
        "I've never done this before: how do I {howto}?",
        "Explain how to {howto} in numbered steps.",
        "How do I {howto}? List the steps, then the most common mistakes to avoid.",
    ],
    # {a}: 3-12, {b}: 2-9, {c}: 2-9 (see `fill_numbers`).
    "math": [
        "{name} buys {a} notebooks that cost ${b} each. How much does {name} spend in total?",
        "{name} reads {a} pages every day. How many pages will {name} have read after {b} weeks?",
        "A recipe needs {b} eggs per batch. How many eggs does {name} need to make {c} batches, "
        "and how many cartons of 12 should {name} buy?",
        "A train travels at {a}0 km per hour for {b} hours. How far does it go?",
        "There are {a} boxes with {b} apples in each box. {name} takes out {c} apples. How many "
        "apples are left in the boxes?",
        "A jacket costs ${a}0 and is on sale for {b}0% off. What is the sale price?",
        "{name} walks {a} km on each weekday and {b} km on each weekend day. How far does {name} "
        "walk in a week?",
        "A garden is {a} meters long and {b} meters wide. What is its area, and how much fencing "
        "is needed to go all the way around it?",
        "{name} saves ${a} every week. How many weeks will it take to save ${b}00?",
        "{name} has {a}{c} cookies and wants to share them equally among {b} friends. How many "
        "does each friend get, and how many are left over?",
        "A water tank holds {a}0 liters and leaks {b} liters per hour. How many hours until it is "
        "empty?",
        "{name} earns ${a} per hour and works {b} hours a day for {c} days. How much does {name} "
        "earn in total? Show your work.",
        "{name} is {a} years old, and {name}'s sister is {b} years older. How old will the sister "
        "be in {c} years?",
        "{name} runs {b} km on Monday and each day after that runs 1 km more than the day before. "
        "How many km does {name} run from Monday to Sunday in total? Explain step by step.",
    ],
}
