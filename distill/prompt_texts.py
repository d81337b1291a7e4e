"""Passages and code snippets of the distillation prompt set (distill/build_prompts.py): its
longest hand-written components; each is a subject the split rule keeps on one side."""

from __future__ import annotations

from typing import NamedTuple


class Snippet(NamedTuple):
    lang: str
    purpose: str
    code: str
    buggy: bool

    @property
    def block(self) -> str:
        fence = {"Python": "python", "JavaScript": "javascript", "SQL": "sql", "Bash": "bash"}
        return f"```{fence[self.lang]}\n{self.code}\n```"



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
