"""Build the prompt set used to distill the draft model from the target model.

Every prompt is the text of one user chat message (the chat template is applied later). Prompts
are composed from the hand-written component lists below (topics, passages, code snippets,
characters, templates, ...) and written to ``distill/prompts.json`` as a list of
``{"id", "category", "split", "prompt"}`` objects.

Split rule (no leakage): the last 10% (at least one item) of EVERY component list, templates
included, is reserved for the held-out split. Train prompts use only train templates and train
components; held-out prompts use only held-out components (with any template). So a held-out
prompt never shares a topic, passage, code snippet, character, name, ... with a train prompt,
and some templates are never seen in training. ``check_no_leakage`` verifies this.

The output is deterministic (the only randomness is ``random.Random(0)``). Regenerate with::

    python distill/build_prompts.py
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter, defaultdict
from itertools import product
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

OUT_PATH = Path(__file__).resolve().parent / "prompts.json"
HELDOUT_FRACTION = 0.1
TRAIN_PER_CATEGORY = 120
HELDOUT_PER_CATEGORY = 12
SEED = 0

T = TypeVar("T")


def split(items: list[T]) -> tuple[list[T], list[T]]:
    """The split rule: the last 10% (at least one) of a list is held out."""
    k = max(1, round(len(items) * HELDOUT_FRACTION))
    return items[:-k], items[-k:]


class Snippet(NamedTuple):
    lang: str
    purpose: str
    code: str
    buggy: bool

    @property
    def block(self) -> str:
        fence = {"Python": "python", "JavaScript": "javascript", "SQL": "sql", "Bash": "bash"}
        return f"```{fence[self.lang]}\n{self.code}\n```"


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
PASSAGES = [
    "Honeybees communicate the location of food through a movement called the waggle dance. A "
    "worker returning to the hive walks in a figure-eight pattern, wiggling her body during the "
    "straight middle section. The angle of that straight run, relative to vertical, tells the "
    "other bees the direction of the flowers relative to the sun. The length of the wiggle tells "
    "them how far away the flowers are. Scientists decoded this dance in the twentieth century, "
    "and it remains one of the most remarkable examples of symbolic communication in animals.",
    "so basically working from home has been great for me but theres some downsides to. I dont "
    "have to commute which saves me like an hour every day, and I can take my dog for a walk at "
    "lunch. But sometimes I feel kind of lonely and its hard to know when to stop working because "
    "my laptop is always right their. My manager is pretty chill about it though, she just wants "
    "us to answer messages during core hours and show up to the weekly video call.",
    "Coral reefs cover less than one percent of the ocean floor, yet they support roughly a "
    "quarter of all marine species. Reefs are built by tiny animals called polyps, which live in "
    "partnership with algae that provide them with food through photosynthesis. When water "
    "becomes too warm, the corals expel these algae and turn white, a process known as bleaching. "
    "If temperatures return to normal quickly, the corals can recover, but repeated heat waves "
    "leave reefs weakened and vulnerable to disease.",
    "Public libraries as we know them are a fairly recent invention. For most of history, books "
    "were expensive and collections belonged to monasteries, universities, or wealthy "
    "individuals. In the nineteenth century, towns in Britain and the United States began opening "
    "free libraries funded by taxes and donations. The idea was that reading should not depend on "
    "wealth. Today many libraries lend far more than books, offering internet access, job-search "
    "help, language classes, and even tools or musical instruments.",
    "Starting on the first of May, the city will open a protected bike lane along Harbor Street "
    "between the train station and the university. The lane will be separated from car traffic by "
    "a low concrete curb, and new traffic signals will give cyclists a short head start at major "
    "intersections. During construction, parking on the east side of the street will be "
    "unavailable. Residents with questions can attend an information session at the community "
    "center on April 12 at 6 p.m.",
    "Sleep is not simply a time when the brain switches off. During the night, we cycle through "
    "several stages, including deep sleep and rapid eye movement, or REM, sleep. Deep sleep "
    "appears to help the body repair tissues and strengthen the immune system, while REM sleep is "
    "linked to memory and emotional processing. Most adults need between seven and nine hours per "
    "night. Regularly getting less can affect mood, concentration, and long-term health, even if "
    "people feel they have adjusted to it.",
    "Iceland sits on the Mid-Atlantic Ridge, where the North American and Eurasian plates are "
    "slowly pulling apart. As the plates separate, molten rock rises to fill the gap, which is why "
    "the island has so many active volcanoes. Icelanders have learned to put this heat to use. "
    "Geothermal plants generate a large share of the country's electricity, and hot water piped "
    "from underground warms most homes. Some towns even heat their sidewalks in winter to keep "
    "them free of ice.",
    "Hi everyone! Just a quick update from the bakery. We're going to be closed next monday and "
    "tuesday because our big oven needs repairs, sorry about that!! The good news is that when we "
    "reopen on wednesday we'll have a new cinnamon roll recipe that Jess has been working on for "
    "weeks and honestly its amazing. Also we're starting a loyalty card, every tenth coffee is "
    "free. Thanks for all your support this year, we couldn't do it without you guys.",
    "The Romans built more than 80,000 kilometers of paved roads across their empire. A typical "
    "road was constructed in layers: a foundation of large stones, a middle layer of gravel and "
    "sand, and a surface of tightly fitted flat stones. Roads were slightly curved so rain would "
    "drain to the sides. They allowed armies to move quickly, but they also carried merchants, "
    "messengers, and ideas. Some Roman roads are still in use today, and many modern European "
    "highways follow their original routes.",
    "Not all plastic that goes into a recycling bin actually gets recycled. Plastics are sorted by "
    "type, marked with a number inside a small triangle, and only some types have a reliable "
    "market. Bottles made from types 1 and 2 are widely recycled, while films, bags, and "
    "mixed-material packaging are often sent to landfill. Food residue can also contaminate an "
    "entire batch. Experts say the most effective approach is to reduce single-use plastic first, "
    "reuse what you can, and recycle as a last step.",
    "Chess engines now play far better than any human, but their influence on the game has been "
    "surprising. Rather than making chess boring, computers have become training partners. Young "
    "players study engine analysis to discover new ideas in openings that were considered settled "
    "for decades. Online platforms let millions of people play quick games at any hour, and "
    "streaming has turned top players into entertainers. The number of people playing chess "
    "regularly has grown substantially in recent years.",
    "Jazz emerged in New Orleans in the early twentieth century, blending African American "
    "musical traditions such as blues and ragtime with brass band music and European harmony. One "
    "of its defining features is improvisation: musicians create melodies on the spot, responding "
    "to each other in real time. Over the decades, jazz branched into many styles, from the big "
    "band swing of the 1930s to the fast, complex bebop of the 1940s and the relaxed cool jazz "
    "that followed.",
    "Community gardens have spread across many cities in the last twenty years. Neighbors rent a "
    "small plot for a modest yearly fee and grow vegetables, herbs, and flowers. Beyond fresh "
    "food, the gardens offer something harder to measure: a place where people of different ages "
    "and backgrounds meet regularly. Studies have linked gardening to lower stress and more "
    "physical activity. Some cities now set aside vacant lots specifically for this purpose, "
    "though finding long-term land remains a challenge.",
    "Meeting notes, Tuesday. Attendees: Ana, Raj, Li, Tom. The website launch is pushed back two "
    "weeks because the payment page failed testing. Raj will fix the checkout bug by Friday. Li is "
    "going to rewrite the product descriptions since the current ones are too long. Tom asked "
    "about the budget for ads, Ana said we have about half of what we hoped for, so we'll focus on "
    "email and social media first. Next meeting is Monday at 10. Ana will send the updated "
    "timeline to everyone.",
    "Every autumn, billions of birds travel thousands of kilometers between their breeding "
    "grounds and wintering areas. Many species migrate at night, navigating by the stars, the "
    "Earth's magnetic field, and landmarks such as coastlines and mountain ranges. Some small "
    "songbirds double their body weight before departure, storing fat as fuel. The bar-tailed "
    "godwit holds one of the most impressive records, flying from Alaska to New Zealand in about "
    "eleven days without stopping to eat or rest.",
    "I started meditating about six months ago, mostly because my sister wouldn't stop talking "
    "about it. At first I couldn't sit still for even five minutes. My mind kept jumping to "
    "emails, dinner plans, and random songs. What helped was starting tiny: two minutes in the "
    "morning, just counting breaths. Now I do about fifteen minutes most days. I wouldn't say it "
    "changed my life, but I notice I'm a bit calmer in traffic and I fall asleep faster.",
    "The Volta S is a compact electric hatchback designed for city driving. Its battery offers a "
    "range of up to 380 kilometers on a single charge, and a fast charger can take it from 10 to "
    "80 percent in about 30 minutes. Inside, there is room for five adults, a large touchscreen, "
    "and a surprisingly roomy trunk. The car comes with a heat pump for efficient winter driving "
    "and an app that lets owners pre-warm the cabin or check the charge level from their phone.",
    "I am writing because I am honestly really frustrated. I ordered a sofa from your website "
    "over six weeks ago and I was told it would arrive in 10 days. Since then the delivery date "
    "has changed three times and nobody calls me back. Last Saturday I stayed home all day waiting "
    "for the delivery and no one showed up. I paid in full upfront. I want to know exactly when "
    "the sofa will arrive, or I want my money back.",
    "Tea has been drunk in China for thousands of years, first as a medicine and later as an "
    "everyday drink. It spread to Japan through Buddhist monks and reached Europe in the "
    "seventeenth century through Dutch and Portuguese traders. In Britain, tea was at first a "
    "luxury for the wealthy, but as prices fell it became the national drink. The British demand "
    "for tea shaped global trade, influencing events from the growth of plantations in India to "
    "conflicts with China.",
    "Glaciers form where more snow falls in winter than melts in summer. Over many years, the "
    "snow is compressed into dense ice that slowly flows downhill under its own weight. As "
    "glaciers move, they grind the rock beneath them, carving U-shaped valleys and leaving behind "
    "piles of rubble called moraines. Many mountain glaciers around the world are shrinking as "
    "temperatures rise. This matters because millions of people rely on glacier meltwater for "
    "drinking water and farming during dry seasons.",
    "Vaccines work by showing the immune system a harmless version or piece of a germ so it can "
    "learn to recognize the real thing. Some vaccines contain weakened or inactivated viruses, "
    "while others contain just a single protein or instructions for making one. After "
    "vaccination, the body produces antibodies and memory cells. If the person later encounters "
    "the actual germ, the immune system can respond much faster, often preventing illness "
    "entirely or making it far less severe.",
    "ok so me and my roommate been trying to budget better. we used to just spend whatever and "
    "then be broke by the end of the month lol. now we put all the shared stuff like rent, "
    "internet and groceries into a spreadsheet and divide it. we also each set aside a little bit "
    "every payday for savings even if its just 20 dollars. its not perfect and we still order "
    "takeout to much but its way better then before.",
    "On July 20, 1969, the Apollo 11 lunar module touched down on the Moon's surface. Neil "
    "Armstrong and Buzz Aldrin spent about two and a half hours walking outside, collecting rock "
    "samples and setting up experiments, while Michael Collins orbited above in the command "
    "module. The mission was watched on television by an estimated 600 million people. The "
    "astronauts returned safely to Earth four days later, fulfilling a goal President Kennedy had "
    "set at the start of the decade.",
    "Origami, the art of folding paper, is usually associated with Japan, where it developed into "
    "a refined tradition. Classic models such as the crane are folded from a single square sheet "
    "without cutting or gluing. In recent decades, origami has found unexpected uses in "
    "engineering. Designers have borrowed folding patterns to pack large solar panels into small "
    "rockets, to create stents that expand inside blood vessels, and to design airbags that "
    "unfold smoothly in a crash.",
    "Training for a first marathon usually takes four to five months. Most plans build "
    "gradually, with one long run each week that increases by a kilometer or two, and easier runs "
    "on other days. Rest days are just as important as running days, because muscles and tendons "
    "need time to adapt. Beginners often make the mistake of running every session too fast. "
    "Coaches recommend doing most runs at a pace comfortable enough to hold a conversation.",
    "Bright one-bedroom apartment available from September. Third floor of a quiet building with "
    "an elevator, five minutes' walk from the subway. The living room has large windows facing "
    "south and a small balcony. The kitchen was renovated last year and includes a dishwasher. "
    "Heating and water are included in the rent; electricity and internet are not. No smoking. "
    "Small pets are allowed with a deposit. Please contact us to arrange a viewing on weekday "
    "evenings or Saturday mornings.",
    "Adopting a dog from a shelter can be deeply rewarding, but it is a long-term commitment. "
    "Before adopting, think honestly about how much time you have for walks, training, and play, "
    "and whether your home suits the size and energy level of the dog. Many shelters will match "
    "you with a dog based on your lifestyle. Expect an adjustment period: a new dog may be anxious "
    "or shy for the first few weeks, and patience and a consistent routine help it settle in.",
    "Open-source software is software whose source code is published so anyone can read, modify, "
    "and share it. Much of the internet runs on open-source projects, from web servers to "
    "programming languages. Contributors range from hobbyists to engineers paid by large "
    "companies. The model has clear strengths, such as transparency and shared effort, but also "
    "weaknesses. Critical projects are sometimes maintained by just one or two volunteers, which "
    "can leave important infrastructure underfunded.",
    "Early maps were as much about beliefs as geography. Medieval European world maps often "
    "placed Jerusalem at the center and filled unknown regions with mythical creatures. As sea "
    "travel expanded in the fifteenth and sixteenth centuries, mapmakers gathered reports from "
    "sailors and drew coastlines more accurately. The Mercator projection, created in 1569, made "
    "navigation easier by keeping compass directions straight, but it also stretched areas near "
    "the poles, making Greenland look almost as large as Africa.",
    "Wind turbines convert the movement of air into electricity. The wind turns long blades "
    "connected to a rotor, which spins a generator inside the housing at the top of the tower. "
    "Modern offshore turbines can be taller than many skyscrapers, with blades longer than a "
    "football field. Wind power is now one of the cheapest sources of new electricity in many "
    "countries. Its main challenge is variability, since the wind does not always blow when "
    "demand is highest.",
    "Desert plants have developed clever ways to survive with very little water. Cacti store "
    "water in thick, fleshy stems and have spines instead of leaves, which reduces water loss. "
    "Many desert plants open their pores only at night, when it is cooler, to take in carbon "
    "dioxide. Others, like some wildflowers, spend most of their lives as seeds, waiting in the "
    "soil for a rare heavy rain, then sprout, bloom, and produce new seeds within a few weeks.",
    "Beginning next term, the school cafeteria will offer a vegetarian option every day in "
    "addition to the regular menu. Families who wish to prepay for meals can do so through the "
    "online portal, and students eligible for free lunches will continue to receive them "
    "automatically. Sugary drinks will no longer be sold on campus. The parent council supported "
    "these changes after a survey in which most families asked for healthier and more varied "
    "choices. Feedback forms will be available at the front office.",
    "The easiest way to improve your photos is to pay attention to light. Soft light early in the "
    "morning or late in the afternoon flatters almost any subject, while harsh midday sun creates "
    "strong shadows. Try to keep the sun behind you or to the side rather than directly behind "
    "the subject. Another simple trick is the rule of thirds: imagine the frame divided into a "
    "three-by-three grid and place the main subject along one of the lines instead of in the "
    "center.",
    "The Silk Road was not a single road but a network of trade routes connecting China with "
    "Central Asia, the Middle East, and Europe. Merchants rarely traveled the entire distance. "
    "Instead, goods passed through many hands, moving from one trading city to the next. Silk, "
    "spices, paper, and glass were exchanged, but so were religions, technologies, and diseases. "
    "Cities such as Samarkand grew wealthy as crossroads where travelers rested, traded, and "
    "shared news.",
    "Octopuses are among the most intelligent invertebrates. They can solve puzzles, open jars, "
    "and escape from aquarium tanks. Unlike humans, most of their neurons are located in their "
    "arms rather than their central brain, which allows each arm to react to its surroundings "
    "somewhat independently. Octopuses also change the color and texture of their skin in a "
    "fraction of a second to blend into their environment. Surprisingly, most species live only "
    "one or two years.",
    "When I was eight, a storm knocked out the power in our whole street for two days. My parents "
    "lit candles, and my brother and I built a fort out of blankets in the living room. We played "
    "cards by flashlight and ate cold cereal for dinner, which felt like the best adventure in "
    "the world. My mom told stories about growing up on a farm. I don't remember much else from "
    "that year, but I still remember the sound of the rain on the windows.",
    "Caffeine works mainly by blocking adenosine, a chemical that builds up in the brain during "
    "the day and makes us feel sleepy. That is why a cup of coffee can make you feel more alert. "
    "The effect lasts several hours: it takes around five hours for the body to clear half of the "
    "caffeine consumed. This explains why an afternoon coffee can still interfere with sleep at "
    "night. Regular drinkers also develop tolerance, needing more caffeine to feel the same "
    "effect.",
    "We are looking for a part-time library assistant to join our friendly team. Duties include "
    "helping visitors find books, checking items in and out, shelving returns, and supporting our "
    "weekly children's reading hour. No previous library experience is required, but you should "
    "enjoy working with people and be comfortable using computers. The position is twenty hours "
    "per week, including one Saturday a month. To apply, please send a short cover letter and "
    "your resume by the end of the month.",
    "Before the printing press, books in Europe were copied by hand, which made them rare and "
    "costly. Around 1450, Johannes Gutenberg developed a system using movable metal type, "
    "oil-based ink, and a press adapted from those used to make wine. A single workshop could now "
    "produce hundreds of copies of a book in the time it once took to copy one. Printed material "
    "spread rapidly, helping to fuel the Reformation, the scientific revolution, and rising "
    "literacy across the continent.",
    "We stayed at this hotel for three nights and honestly it was ok but not great. The location "
    "is perfect, right next to the old town and the beach, and the breakfast was really good with "
    "lots of fresh fruit. But our room was tiny and the air conditioning was so loud we could "
    "barely sleep. The staff was nice but they forgot to clean our room one day. For the price I "
    "expected abit more. Would maybe stay again if they fix the AC.",
    # Held out (last 10%).
    "Sea otters spend almost their entire lives in the water along the coasts of the North "
    "Pacific. Unlike most marine mammals, they have no layer of blubber. Instead, they stay warm "
    "thanks to the densest fur of any animal, with up to a million hairs per square inch. Otters "
    "spend hours grooming to keep air trapped in their fur. They are also famous for using tools, "
    "floating on their backs and cracking open shellfish with rocks balanced on their chests.",
    "Chocolate began as a bitter drink. The Olmec, Maya, and Aztec peoples of Mesoamerica ground "
    "roasted cacao beans and mixed them with water, chili, and spices, and cacao beans were "
    "valuable enough to be used as money. When Spanish explorers brought cacao to Europe in the "
    "sixteenth century, cooks added sugar and it became fashionable among the wealthy. Solid "
    "chocolate bars only appeared in the nineteenth century, after new machines made it possible "
    "to press cocoa butter and grind the beans finely.",
    "hey team, quick heads up about the office move. we're moving to the new building on Elm "
    "avenue on the 15th, so please pack your desks by the 13th, boxes are in the kitchen. IT will "
    "disconnect computers thursday evening so save your work before you leave. parking at the new "
    "place is limited so if you can take the bus that would be great, theres a stop right outside. "
    "let me know if you have any questions or need extra boxes!",
    "Until the nineteenth century, most towns kept their own local time, setting clocks by the "
    "position of the sun. Noon in one city might be several minutes different from noon in a town "
    "just down the road. This became a real problem once railways allowed people to travel "
    "quickly between places, because timetables were confusing and even dangerous. Railway "
    "companies began adopting standard times, and in 1884 an international conference "
    "established the system of time zones based on the Greenwich meridian.",
]

# Short code snippets for "explain this code" and "fix this bug" prompts.
SNIPPETS = [
    Snippet("Python", "return the average of a list of numbers", (
        "def average(numbers):\n"
        "    total = 0\n"
        "    for n in numbers:\n"
        "        total += n\n"
        "    return total / len(numbers)"), buggy=False),
    Snippet("Python", "count the vowels in a string", (
        "def count_vowels(text):\n"
        "    count = 0\n"
        "    for ch in text:\n"
        "        if ch in \"aeiou\":\n"
        "            count += 1\n"
        "        return count"), buggy=True),
    Snippet("Python", "print the squares of the even numbers below 10", (
        "squares = [x * x for x in range(10) if x % 2 == 0]\n"
        "print(squares)"), buggy=False),
    Snippet("Python", "compute n factorial", (
        "def factorial(n):\n"
        "    result = 1\n"
        "    for i in range(1, n):\n"
        "        result *= i\n"
        "    return result"), buggy=True),
    Snippet("JavaScript", "wait until calls stop for a while before running a function", (
        "function debounce(fn, delay) {\n"
        "  let timer;\n"
        "  return (...args) => {\n"
        "    clearTimeout(timer);\n"
        "    timer = setTimeout(() => fn(...args), delay);\n"
        "  };\n"
        "}"), buggy=False),
    Snippet("JavaScript", "add up all the numbers in an array", (
        "function sumArray(arr) {\n"
        "  let total = 0;\n"
        "  for (let i = 0; i <= arr.length; i++) {\n"
        "    total += arr[i];\n"
        "  }\n"
        "  return total;\n"
        "}"), buggy=True),
    Snippet("SQL", "report headcount and average salary for large departments", (
        "SELECT department, COUNT(*) AS employees, AVG(salary) AS avg_salary\n"
        "FROM staff\n"
        "GROUP BY department\n"
        "HAVING COUNT(*) > 5\n"
        "ORDER BY avg_salary DESC;"), buggy=False),
    Snippet("Bash", "change the extension of every .jpg file to .jpeg", (
        "for f in *.jpg; do\n"
        "  mv \"$f\" \"${f%.jpg}.jpeg\"\n"
        "done"), buggy=False),
    Snippet("Python", "return a new basket containing just the item when no basket is given", (
        "def add_item(item, basket=[]):\n"
        "    basket.append(item)\n"
        "    return basket"), buggy=True),
    Snippet("Python", "count how often each word appears in a text", (
        "def word_counts(text):\n"
        "    counts = {}\n"
        "    for word in text.lower().split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n"
        "    return counts"), buggy=False),
    Snippet("JavaScript", "return true when the age is 18 or more", (
        "function isAdult(age) {\n"
        "  if (age = 18 || age > 18) {\n"
        "    return true;\n"
        "  }\n"
        "  return false;\n"
        "}"), buggy=True),
    Snippet("Python", "find the index of a target value in a sorted list", (
        "def binary_search(items, target):\n"
        "    lo, hi = 0, len(items) - 1\n"
        "    while lo <= hi:\n"
        "        mid = (lo + hi) // 2\n"
        "        if items[mid] == target:\n"
        "            return mid\n"
        "        elif items[mid] < target:\n"
        "            lo = mid\n"
        "        else:\n"
        "            hi = mid - 1\n"
        "    return -1"), buggy=True),
    Snippet("Python", "read a CSV file into a header and data rows", (
        "with open(\"data.csv\") as f:\n"
        "    rows = [line.strip().split(\",\") for line in f if line.strip()]\n"
        "header, data = rows[0], rows[1:]"), buggy=False),
    Snippet("JavaScript", "load a user record from the API", (
        "async function getUser(id) {\n"
        "  const res = await fetch(`/api/users/${id}`);\n"
        "  if (!res.ok) throw new Error(`HTTP ${res.status}`);\n"
        "  return res.json();\n"
        "}"), buggy=False),
    Snippet("SQL", "list customers who placed more than three orders", (
        "SELECT name, COUNT(order_id)\n"
        "FROM customers\n"
        "JOIN orders ON customers.id = orders.customer_id\n"
        "WHERE COUNT(order_id) > 3;"), buggy=True),
    Snippet("Bash", "count the .txt files in the current folder", (
        "#!/bin/bash\n"
        "count=0\n"
        "for file in *.txt; do\n"
        "  count=$count+1\n"
        "done\n"
        "echo \"Found $count text files\""), buggy=True),
    Snippet("Python", "print how long a function call takes", (
        "import time\n"
        "\n"
        "def timed(func):\n"
        "    def wrapper(*args, **kwargs):\n"
        "        start = time.perf_counter()\n"
        "        result = func(*args, **kwargs)\n"
        "        print(f\"{func.__name__} took {time.perf_counter() - start:.3f}s\")\n"
        "        return result\n"
        "    return wrapper"), buggy=False),
    Snippet("Python", "compute the percentage change from an old value to a new value", (
        "def percent_change(old, new):\n"
        "    return (new - old) / new * 100"), buggy=True),
    Snippet("JavaScript", "compute the total price of the in-stock items in a cart", (
        "const total = cart\n"
        "  .filter(item => item.inStock)\n"
        "  .map(item => item.price * item.qty)\n"
        "  .reduce((sum, x) => sum + x, 0);"), buggy=False),
    Snippet("Python", "remove all negative numbers from a list", (
        "def remove_negatives(nums):\n"
        "    for n in nums:\n"
        "        if n < 0:\n"
        "            nums.remove(n)\n"
        "    return nums"), buggy=True),
    # Held out (last 10%).
    Snippet("Python", "check that a password is at least 8 characters with a digit and a capital", (
        "def is_valid_password(pw):\n"
        "    return (len(pw) >= 8\n"
        "            and any(c.isdigit() for c in pw)\n"
        "            and any(c.isupper() for c in pw))"), buggy=False),
    Snippet("JavaScript", "return the number of whole days between two Date objects", (
        "function daysBetween(a, b) {\n"
        "  const ms = b - a;\n"
        "  return ms / 1000 * 60 * 60 * 24;\n"
        "}"), buggy=True),
]

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


# ---------------------------------------------------------------------------------------------
# Slots: placeholder name -> component list. Subject lists are split; shared lists are not.
# ---------------------------------------------------------------------------------------------

def subject_slots() -> dict[str, list[Any]]:
    """Every placeholder whose values carry a subject (and so must be split)."""
    topics = [t for domain in TOPICS.values() for t in domain]
    return {
        "topic": topics,
        "tip": TIP_SUBJECTS,
        "pair": COMPARE_PAIRS,
        "task": CODE_TASKS,
        "sql_task": SQL_TASKS,
        "bash_task": BASH_TASKS,
        "snippet": SNIPPETS,
        "passage": PASSAGES,
        "things": LIST_SUBJECTS,
        "character": STORY_CHARACTERS,
        "setting": STORY_SETTINGS,
        "subject": POEM_SUBJECTS,
        "mail": MAIL_TASKS,
        "term": DEFINITION_TERMS,
        "howto": HOWTO_TASKS,
        "name": MATH_NAMES,
    }


SHARED_SLOTS: dict[str, list[str]] = {
    "lang": LANGS, "tone": TONES, "form": POEM_FORMS, "n": COUNTS,
}


def split_slots() -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Apply the split rule to each subject list (topics: per domain, so every domain is held
    out a little). ``bug`` is derived from the already-split snippets."""
    train: dict[str, list[Any]] = {}
    heldout: dict[str, list[Any]] = {}
    for key, items in subject_slots().items():
        if key == "topic":
            parts = [split(domain) for domain in TOPICS.values()]
            train[key] = [t for tr, _ in parts for t in tr]
            heldout[key] = [t for _, ho in parts for t in ho]
        else:
            train[key], heldout[key] = split(items)
    for slots in (train, heldout):
        slots["bug"] = [s for s in slots["snippet"] if s.buggy]
        slots.update(SHARED_SLOTS)
    return train, heldout


def placeholders(template: str) -> list[str]:
    """Base placeholder names in a template ("{pair.a}" -> "pair"), in order, without repeats."""
    names = [f for _, f, _, _ in string.Formatter().parse(template) if f]
    return list(dict.fromkeys(re.split(r"[.\[]", f)[0] for f in names))


NUMBER_SLOTS = {"a": range(3, 13), "b": range(2, 10), "c": range(2, 10)}


def expand(template: str, slots: dict[str, list[Any]], rng: random.Random) -> list[str]:
    """All fillings of one template from the given slots. Number slots ({a}, {b}, {c}) are drawn
    from `rng`, three draws per combination of the other slots."""
    names = placeholders(template)
    numeric = [n for n in names if n in NUMBER_SLOTS]
    other = [n for n in names if n not in NUMBER_SLOTS]
    out = []
    for values in product(*(slots[n] for n in other)):
        fields = dict(zip(other, values))
        for _ in range(3 if numeric else 1):
            nums = {n: rng.choice(NUMBER_SLOTS[n]) for n in numeric}
            out.append(template.format(**fields, **nums))
    return out


def sample_balanced(
    templates: list[str], slots: dict[str, list[Any]], quota: int, rng: random.Random,
    taken: set[str],
) -> list[str]:
    """Up to `quota` distinct prompts, spread evenly over templates (round-robin over
    per-template shuffled candidates). Prompts already in `taken` are skipped."""
    pools = []
    for template in templates:
        pool = list(dict.fromkeys(expand(template, slots, rng)))
        rng.shuffle(pool)
        pools.append(pool)
    chosen: list[str] = []
    while len(chosen) < quota and any(pools):
        for pool in pools:
            while pool and pool[-1] in taken:
                pool.pop()
            if pool and len(chosen) < quota:
                prompt = pool.pop()
                taken.add(prompt)
                chosen.append(prompt)
    return chosen


def component_texts(item: Any) -> list[str]:
    """The subject-bearing strings of a component, used for the leakage check."""
    if isinstance(item, Snippet):
        return [item.code, item.purpose]
    if isinstance(item, MailTask):
        return [item.about]
    if isinstance(item, Pair):
        return [item.a, item.b]
    return [item]


def check_no_leakage(records: list[dict[str, str]], heldout: dict[str, list[Any]]) -> None:
    """No held-out subject string may occur (as a whole word/phrase) in any train prompt."""
    train_text = "\n".join(r["prompt"] for r in records if r["split"] == "train")
    for key in subject_slots():
        for item in heldout[key]:
            for text in component_texts(item):
                pattern = r"(?<!\w)" + re.escape(text) + r"(?!\w)"
                if re.search(pattern, train_text, flags=re.IGNORECASE):
                    raise AssertionError(f"held-out {key} leaks into train: {text[:60]!r}")
    train_prompts = {r["prompt"] for r in records if r["split"] == "train"}
    assert not any(r["prompt"] in train_prompts for r in records if r["split"] == "heldout")


def validate_components() -> None:
    for i, passage in enumerate(PASSAGES):
        words = len(passage.split())
        assert 60 <= words <= 150, f"passage {i} has {words} words"
    assert len(set(PASSAGES)) == len(PASSAGES) >= 40
    assert len({s.code for s in SNIPPETS}) == len(SNIPPETS) >= 15
    assert any(s.buggy for s in split(SNIPPETS)[1]), "held-out snippets need a buggy one"


def build() -> list[dict[str, str]]:
    validate_components()
    rng = random.Random(SEED)
    train_slots, heldout_slots = split_slots()
    taken: set[str] = set()
    records: list[dict[str, str]] = []
    for category, templates in TEMPLATES.items():
        train_templates, _ = split(templates)
        prompts = [
            ("train", p)
            for p in sample_balanced(train_templates, train_slots, TRAIN_PER_CATEGORY, rng, taken)
        ] + [
            ("heldout", p)
            for p in sample_balanced(templates, heldout_slots, HELDOUT_PER_CATEGORY, rng, taken)
        ]
        for i, (split_name, prompt) in enumerate(prompts, start=1):
            records.append(
                {"id": f"{category}-{i:04d}", "category": category, "split": split_name,
                 "prompt": prompt}
            )
    check_no_leakage(records, heldout_slots)
    return records


def main() -> None:
    records = build()
    OUT_PATH.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    by_cat: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        by_cat[r["category"]][r["split"]] += 1
    print(f"{'category':<12} {'train':>6} {'heldout':>8}")
    for category, counts in by_cat.items():
        print(f"{category:<12} {counts['train']:>6} {counts['heldout']:>8}")
    splits = Counter(r["split"] for r in records)
    print(f"{'total':<12} {splits['train']:>6} {splits['heldout']:>8}  ({len(records)} prompts, "
          f"{splits['heldout'] / len(records):.1%} held out) -> {OUT_PATH}")


if __name__ == "__main__":
    main()
